"""Tokenizers made without any vocabulary file, so the embedded models need no download."""

from __future__ import annotations

import json
import string
from pathlib import Path


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
