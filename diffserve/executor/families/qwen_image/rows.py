"""Qwen-Image's attention over rows of different sizes
(:mod:`~diffserve.executor.families.row_sizes`): the text tokens (each prompt's own, padded and
masked as in any forward), then each row's image tokens padded to the longest row's. Each row
has its own rotary positions: its image grid's, and its text's, which start past its own grid
(so they too depend on the row's size). The projections and norms are the model's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffserve.executor.families.row_sizes import RowSizes, by_row, masked_backend, rotate_complex


@dataclass(frozen=True)
class QwenRows:
    """Each row's rotary frequencies (complex: rows, tokens, dim / 2) for its image tokens
    (padded to the longest row's) and its text tokens, and each row's valid image tokens."""

    image: Any
    text: Any
    valid: Any


def qwen_rows(torch, transformer, rows: RowSizes, grids: dict, text_length: int,
              device) -> QwenRows:
    """The rows' positions: ``grids`` maps each size to its (frames, height, width) token grid;
    ``text_length``: the forward's text tokens."""
    image, text = {}, {}
    for size in rows.distinct():
        image[size], text[size] = transformer.pos_embed([grids[size]], max_txt_seq_len=text_length,
                                                        device=device)
    ones = lambda shape, like: like.new_ones(shape)  # noqa: E731 - the padding turns nothing
    return QwenRows(by_row(torch, image, rows, rows.length, ones),
                    torch.stack([text[size] for size in rows.sizes]), rows.valid(torch, device))


class RowsProcessor:
    """The per-row processor standing in for ``inner`` (a ``QwenDoubleStreamAttnProcessor2_0``)
    in a mixed forward: the same computation with each row's positions and the padding
    masked. (A class with the processor's own signature: the attention module passes on only
    the keywords its processor's ``__call__`` names.)"""

    def __init__(self, inner, rows: QwenRows) -> None:
        self.inner, self.rows = inner, rows

    def __call__(self, attn, hidden_states, encoder_hidden_states=None,
                 encoder_hidden_states_mask=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        import torch

        rows, inner = self.rows, self.inner
        head_dim = attn.inner_dim // attn.heads
        split = lambda t: t.unflatten(-1, (-1, head_dim))  # noqa: E731
        image_q, image_k, image_v = (split(f(hidden_states))
                                     for f in (attn.to_q, attn.to_k, attn.to_v))
        text_q, text_k, text_v = (split(f(encoder_hidden_states))
                                  for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_q is not None:
            image_q = attn.norm_q(image_q)
        if attn.norm_k is not None:
            image_k = attn.norm_k(image_k)
        if attn.norm_added_q is not None:
            text_q = attn.norm_added_q(text_q)
        if attn.norm_added_k is not None:
            text_k = attn.norm_added_k(text_k)
        image_q, image_k = rotate_complex(image_q, rows.image), rotate_complex(image_k, rows.image)
        text_q, text_k = rotate_complex(text_q, rows.text), rotate_complex(text_k, rows.text)
        text_mask = (encoder_hidden_states_mask.bool() if encoder_hidden_states_mask is not None
                     else rows.valid.new_ones(text_q.shape[:2]))
        mask = torch.cat([text_mask, rows.valid], dim=1)[:, None, None, :]
        out = dispatch_attention_fn(
            torch.cat([text_q, image_q], 1), torch.cat([text_k, image_k], 1),
            torch.cat([text_v, image_v], 1), attn_mask=mask, dropout_p=0.0, is_causal=False,
            backend=masked_backend(inner))
        out = out.flatten(2, 3).to(text_q.dtype)
        seq_text = encoder_hidden_states.shape[1]
        image = attn.to_out[0](out[:, seq_text:].contiguous())
        if len(attn.to_out) > 1:
            image = attn.to_out[1](image)
        return image, attn.to_add_out(out[:, :seq_text].contiguous())


def kinds() -> tuple[type, ...]:
    """The processors a mixed forward stands in for (the model's own)."""
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    return (QwenDoubleStreamAttnProcessor2_0,)
