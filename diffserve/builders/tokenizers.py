"""Tokenizers made without any vocabulary file, so the embedded models need no download."""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from pathlib import Path
from typing import Iterable


def byte_characters() -> list[str]:
    """The 256 printable stand-ins byte-level BPE vocabularies use for the 256 byte values:
    printable Latin-1 bytes stand for themselves, the rest map to code points from 256 up."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def write_byte_clip_tokenizer(directory: Path, max_length: int = 77):
    """A CLIP tokenizer over bytes: 256 byte symbols, the same with the end-of-word mark, then
    the start and end tokens (514 in all), and no merges. Returns the loaded tokenizer."""
    from transformers import CLIPTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    chars = byte_characters()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": 256 + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = 512
    vocab["<|endoftext|>"] = 513
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"),
                              model_max_length=max_length)
    for leftover in ("vocab.json", "merges.txt"):
        (directory / leftover).unlink()
    return tokenizer


def character_t5_tokenizer():
    """A T5 (Unigram) tokenizer whose pieces are single characters and word-initial letters."""
    from transformers import T5Tokenizer

    word_start = "\u2581"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), (word_start, -2.0)]
    pieces += [(c, -3.0) for c in string.printable if not c.isspace()]
    pieces += [(word_start + c, -2.5) for c in string.ascii_letters + string.digits]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def write_character_bert_tokenizer(directory: Path):
    """A lower-casing WordPiece (BERT) tokenizer over single characters: the five special tokens,
    lowercase letters, digits and punctuation, then the letters and digits again as word
    continuations (``##a``) so that a word spells out instead of collapsing to [UNK]. Writes its
    vocab.txt in ``directory`` and returns the loaded tokenizer."""
    from transformers import BertTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    alphanumerics = string.ascii_lowercase + string.digits
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens += list(alphanumerics) + list(string.punctuation) + ["##" + c for c in alphanumerics]
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(tokens) + "\n")
    tokenizer = BertTokenizer(vocab=str(vocab), do_lower_case=True)
    vocab.unlink()
    return tokenizer


def learn_merges(words: Iterable[str]) -> list[tuple[str, str]]:
    """BPE merges, learnt from ``words`` until each of them is a single token: always the most
    frequent pair next (ties: the smallest), so the same words always give the same merges."""
    counts = Counter(words)
    splits = {word: tuple(word) for word in counts}
    merges: list[tuple[str, str]] = []
    while True:
        pairs: Counter = Counter()
        for word, symbols in splits.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += counts[word]
        if not pairs:
            return merges
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        splits = {word: _merge(symbols, best) for word, symbols in splits.items()}


def _merge(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(symbols):
        if symbols[i:i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def _with_merges(vocab: dict[str, int], merges: list[tuple[str, str]]) -> dict[str, int]:
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    return vocab


QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                       "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def qwen2_tokenizer(texts: Iterable[str]):
    """A byte-level BPE Qwen2 tokenizer: the 256 byte symbols, merges that make each word of
    ``texts`` one token, then Qwen's chat and vision special tokens. Learning the words of a
    pipeline's prompt template keeps that template as many tokens as with the real vocabulary,
    which matters where the pipeline drops a fixed number of leading tokens."""
    from transformers import Qwen2Tokenizer

    byte_vocab = {c: i for i, c in enumerate(byte_characters())}
    # Words are split as the tokenizer itself splits text (Qwen's regex, then bytes to symbols).
    bare = Qwen2Tokenizer(vocab=dict(byte_vocab), merges=[])
    pre_tokenizer = bare.backend_tokenizer.pre_tokenizer
    specials = re.compile("|".join(re.escape(token) for token in QWEN_SPECIAL_TOKENS))
    words = [piece for text in texts for part in specials.split(text)
             for piece, _ in pre_tokenizer.pre_tokenize_str(part)]
    merges = learn_merges(words)
    vocab = _with_merges(byte_vocab, merges)
    vocab.update({token: len(vocab) + i for i, token in enumerate(QWEN_SPECIAL_TOKENS)})
    return Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>",
                          pad_token="<|endoftext|>",
                          extra_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]))


def gemma_tokenizer(texts: Iterable[str]):
    """A Gemma tokenizer: special tokens, the 256 byte-fallback tokens, printable ASCII and the
    word-start mark, then merges that make each word of ``texts`` one token (other text spells
    out by characters, or by bytes beyond ASCII). Adds <bos> in front, as Gemma's does."""
    from transformers import GemmaTokenizer

    word_start = "\u2581"
    # Gemma turns spaces into the word-start mark, which then begins the next word's token.
    spaced = (text.replace(" ", word_start) for text in texts)
    words = [word for text in spaced for word in re.findall(f"{word_start}?[^{word_start}]+", text)]
    merges = learn_merges(words)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [word_start, "\n"] + [c for c in string.printable if not c.isspace()]
    vocab = _with_merges({token: i for i, token in enumerate(tokens)}, merges)
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
