"""Wan over videos of different sizes and frame counts in one forward: the latents come padded
along frames, height and width (:func:`~diffserve.executor.families.row_sizes.padded_rows`).
Its patches do not overlap and its rotary positions count from each axis's start, so a row in
the first corner of the padded grid gets exactly its own patches and positions from the model's
own layers; the grid's other cells are masked out of self-attention
(:func:`~diffserve.executor.families.patched_rows.grid_valid`). The text's cross-attention
needs nothing."""

from __future__ import annotations

import copy

from diffserve.executor.families.row_sizes import masked_backend


class SelfMasked:
    """Stands in for ``WanAttnProcessor`` in a mixed forward: its self-attention gets ``mask``
    (rows, 1, 1, cells). (A class with the processor's own signature: an attention module
    passes on only the keywords its processor names.)"""

    def __init__(self, inner, mask) -> None:
        self.inner = copy.copy(inner)  # on a kernel that takes the mask
        self.inner._attention_backend = masked_backend(inner)
        self.mask = mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        if encoder_hidden_states is None:  # self-attention over the grid
            attention_mask = self.mask
        return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


def kinds() -> tuple[type, ...]:
    """The processors a mixed forward stands in for (the model's own)."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    return (WanAttnProcessor,)
