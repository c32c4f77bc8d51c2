"""SD3's joint attention over rows of different sizes laid out in the union grid
(:mod:`~diffserve.executor.families.patched_rows`): the model's own projections and norms, the
image tokens then the text tokens, and a key mask over the grid cells no row's image covers."""

from __future__ import annotations


class RowsProcessor:
    """Stands in for ``JointAttnProcessor2_0`` in a mixed forward; ``valid``: (rows, image
    tokens) bool. (A class with the processor's own signature: an attention module passes on
    only the keywords its processor names.)"""

    def __init__(self, inner, valid) -> None:
        self.inner, self.valid = inner, valid

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 *args, **kwargs):
        import torch
        import torch.nn.functional as F

        rows, image = hidden_states.shape[0], hidden_states.shape[1]
        split = lambda t: t.view(rows, -1, attn.heads, t.shape[-1] // attn.heads).transpose(1, 2)  # noqa: E731
        query, key, value = (split(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        mask = self.valid
        if encoder_hidden_states is not None:
            text_q, text_k, text_v = (split(f(encoder_hidden_states))
                                      for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                text_q = attn.norm_added_q(text_q)
            if attn.norm_added_k is not None:
                text_k = attn.norm_added_k(text_k)
            query = torch.cat([query, text_q], dim=2)
            key = torch.cat([key, text_k], dim=2)
            value = torch.cat([value, text_v], dim=2)
            mask = torch.cat([mask, mask.new_ones((rows, encoder_hidden_states.shape[1]))], 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None, None, :],
                                             dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(rows, -1, out.shape[1] * out.shape[3]).to(query.dtype)
        text = None
        if encoder_hidden_states is not None:
            out, text = out[:, :image], out[:, image:]
            if not attn.context_pre_only:
                text = attn.to_add_out(text)
        out = attn.to_out[1](attn.to_out[0](out))
        return out if encoder_hidden_states is None else (out, text)


def kinds() -> tuple[type, ...]:
    """The processors a mixed forward stands in for (the model's own)."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    return (JointAttnProcessor2_0,)
