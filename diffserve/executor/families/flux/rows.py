"""Flux's attention over rows of different sizes (:mod:`~diffserve.executor.families.row_sizes`):
the text tokens, then each row's image tokens padded to the longest row's; each row's own rotary
positions (its text ids, then its own image ids), and a key mask over the padding. The
projections, norms and output layers are the model's own; only the positions and the mask are
per row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffserve.executor.families.row_sizes import RowSizes, by_row, masked_backend, rotate_pairs


@dataclass(frozen=True)
class FluxRows:
    """What every attention of a mixed forward shares: each row's rotary (cos, sin: rows,
    tokens, dim) over [text, padded image] and the key mask (rows, 1, 1, tokens)."""

    cos: Any
    sin: Any
    mask: Any


def flux_rows(torch, transformer, rows: RowSizes, text_ids, image_ids: dict) -> FluxRows:
    """The rows' positions: ``image_ids`` maps each size to its image tokens' ids."""
    return rows_of(torch, rows, text_ids.shape[0], {
        size: transformer.pos_embed(torch.cat([text_ids, image_ids[size]], dim=0))
        for size in rows.distinct()}, text_ids.device)


def rows_of(torch, rows: RowSizes, text_length: int, positions: dict, device) -> FluxRows:
    """``positions``: each size's (cos, sin) over its text tokens, then its image tokens."""
    cos = {size: c for size, (c, _) in positions.items()}
    sin = {size: s for size, (_, s) in positions.items()}
    length = text_length + rows.length
    ones = lambda shape, like: like.new_ones(shape)  # noqa: E731 - the padding turns nothing
    zeros = lambda shape, like: like.new_zeros(shape)  # noqa: E731
    valid = rows.valid(torch, device)
    text = valid.new_ones((len(rows.tokens), text_length))
    mask = torch.cat([text, valid], dim=1)[:, None, None, :]
    return FluxRows(by_row(torch, cos, rows, length, ones), by_row(torch, sin, rows, length, zeros),
                    mask)


def masked(rows: FluxRows, attention_mask):
    """The forward's key mask; beside a float bias the model hands its processors (Chroma's),
    the bias kept and the padding masked."""
    return (rows.mask if attention_mask is None
            else attention_mask.masked_fill(~rows.mask, float("-inf")))


def joint_attention(attn, rows: FluxRows, inner, projections, attention_mask):
    """A Flux-style joint attention over ``projections`` (query, key, value of the image
    stream, then of the text stream or None): the text's before the image's, each row with its
    own positions, the padding masked; the output before the attention's out-projections."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    import torch

    query, key, value, text_q, text_k, text_v = projections
    query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value))
    query, key = attn.norm_q(query), attn.norm_k(key)
    if attn.added_kv_proj_dim is not None:
        text_q, text_k, text_v = (t.unflatten(-1, (-1, attn.head_dim))
                                  for t in (text_q, text_k, text_v))
        text_q, text_k = attn.norm_added_q(text_q), attn.norm_added_k(text_k)
        query = torch.cat([text_q, query], dim=1)
        key = torch.cat([text_k, key], dim=1)
        value = torch.cat([text_v, value], dim=1)
    query = rotate_pairs(query, rows.cos, rows.sin)
    key = rotate_pairs(key, rows.cos, rows.sin)
    out = dispatch_attention_fn(query, key, value, attn_mask=masked(rows, attention_mask),
                                backend=masked_backend(inner))
    return out.flatten(2, 3).to(query.dtype)


class RowsProcessor:
    """The per-row processor standing in for ``inner`` (a ``FluxAttnProcessor``) in a mixed
    forward: the same computation with each row's positions and the padding masked. (A class
    with the processor's own signature: an attention module passes on only the keywords its
    processor's ``__call__`` names.)"""

    def __init__(self, inner, rows: FluxRows) -> None:
        self.inner, self.rows = inner, rows

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        out = joint_attention(attn, self.rows, self.inner, _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states), attention_mask)
        if encoder_hidden_states is None:
            return out
        text, image = out.split_with_sizes(
            [encoder_hidden_states.shape[1], out.shape[1] - encoder_hidden_states.shape[1]], dim=1)
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        return image, attn.to_add_out(text.contiguous())


def kinds() -> tuple[type, ...]:
    """The processors a mixed forward stands in for (the model's own)."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    return (FluxAttnProcessor,)
