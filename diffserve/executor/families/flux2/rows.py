"""FLUX.2's attention over rows of different sizes
(:mod:`~diffserve.executor.families.row_sizes`): as Flux's (:mod:`..flux.rows`), for its two
processors, the double-stream blocks' and the single-stream blocks' (whose attention and MLP
share one projection). Each row's rotary positions are its text ids' then its own image ids'."""

from __future__ import annotations

from diffserve.executor.families.flux.rows import FluxRows, joint_attention, masked, rows_of
from diffserve.executor.families.row_sizes import RowSizes, masked_backend, rotate_pairs


def flux2_rows(torch, transformer, rows: RowSizes, text_ids, image_ids: dict) -> FluxRows:
    """The rows' positions: ``image_ids`` maps each size to its image tokens' ids."""
    text_cos, text_sin = transformer.pos_embed(text_ids)
    positions = {}
    for size in rows.distinct():
        cos, sin = transformer.pos_embed(image_ids[size])
        positions[size] = (torch.cat([text_cos, cos]), torch.cat([text_sin, sin]))
    return rows_of(torch, rows, text_ids.shape[0], positions, text_ids.device)


class DoubleProcessor:
    """Stands in for ``Flux2AttnProcessor`` in a mixed forward. (A class with the processor's
    own signature: an attention module passes on only the keywords its processor names.)"""

    def __init__(self, inner, rows: FluxRows) -> None:
        self.inner, self.rows = inner, rows

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        from diffusers.models.transformers.transformer_flux2 import _get_qkv_projections

        out = joint_attention(attn, self.rows, self.inner, _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states), attention_mask)
        text = None
        if encoder_hidden_states is not None:
            text, out = out.split_with_sizes(
                [encoder_hidden_states.shape[1], out.shape[1] - encoder_hidden_states.shape[1]], 1)
            text = attn.to_add_out(text)
        out = attn.to_out[1](attn.to_out[0](out))
        return out if text is None else (out, text)


class SingleProcessor:
    """Stands in for ``Flux2ParallelSelfAttnProcessor`` in a mixed forward."""

    def __init__(self, inner, rows: FluxRows) -> None:
        self.inner, self.rows = inner, rows

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        import torch

        rows = self.rows
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim, mlp_dim = 3 * attn.inner_dim, attn.mlp_hidden_dim * attn.mlp_mult_factor
        local = projected.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp = torch.split(projected, [local, projected.shape[-1] - local], dim=-1)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
        query, key = attn.norm_q(query), attn.norm_k(key)
        query = rotate_pairs(query, rows.cos, rows.sin)
        key = rotate_pairs(key, rows.cos, rows.sin)
        out = dispatch_attention_fn(query, key, value, attn_mask=masked(rows, attention_mask),
                                    backend=masked_backend(self.inner))
        out = out.flatten(2, 3).to(query.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


def kinds() -> tuple[type, ...]:
    """The processors a mixed forward stands in for (the model's own)."""
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2AttnProcessor,
        Flux2ParallelSelfAttnProcessor,
    )

    return (Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor)


def processor(inner, rows: FluxRows):
    """The stand-in for ``inner``, by its kind."""
    from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor

    return (DoubleProcessor if isinstance(inner, Flux2AttnProcessor) else SingleProcessor)(
        inner, rows)
