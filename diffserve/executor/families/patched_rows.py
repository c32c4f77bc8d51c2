"""Rows of different sizes in one forward of a transformer that patchifies its latents itself
and adds positions per size in its first layer (SD3): the rows' latents come padded to the
tallest and the widest (:func:`~.row_sizes.padded_rows`), each row is patchified at its own size
with its own size's positions, and its tokens are laid out at their places in the grid of the
padded latents (the union grid), so that the transformer's own unpatchify returns each row's
prediction in the top-left corner of the padded latents, where :func:`~.row_sizes.own_part`
cuts it. The grid's other cells are padding, masked out of attention.

Rows of other aspect ratios pad more here than where tokens are padded to the longest row's
(a 1024x1536 row beside a 1536x1024 one fills a 1536x1536 grid): docs/batching.md."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


def grid_valid(torch, sides: list[tuple[int, ...]], patch, device):
    """(rows, grid cells) bool: True at each row's own tokens, its latent cells (h, w), or
    (frames, h, w), laid out from the grid's first corner in the grid of the largest along every
    axis; ``patch``: cells a token along each axis (one number: every axis)."""
    axes = len(sides[0])
    patch = (patch,) * axes if isinstance(patch, int) else tuple(patch)
    grid = [max(s[a] for s in sides) // patch[a] for a in range(axes)]
    at = torch.meshgrid(*(torch.arange(g, device=device) for g in grid), indexing="ij")
    return torch.stack([
        torch.stack([at[a] < s[a] // patch[a] for a in range(axes)]).all(0).flatten()
        for s in sides])


@contextmanager
def patched_per_row(torch, embed, sides: list[tuple[int, int]], valid) -> Iterator[None]:
    """For the duration, ``embed`` (a patch embedding: latents to tokens with positions) embeds
    each row at its own (h, w) latent cells and scatters its tokens to their grid places."""
    own = "forward" in vars(embed)  # a hook's wrapper, where one is installed
    original = embed.forward

    def forward(latents):
        out = None
        for side in dict.fromkeys(sides):
            index = [i for i, s in enumerate(sides) if s == side]
            h, w = side
            tokens = original(latents[index, :, :h, :w])
            if out is None:
                out = tokens.new_zeros((latents.shape[0], valid.shape[1], tokens.shape[-1]))
            at = torch.tensor(index, device=latents.device)
            cells = valid[index[0]].nonzero().squeeze(1)
            out[at[:, None], cells[None, :]] = tokens
        return out

    embed.forward = forward
    try:
        yield
    finally:
        if own:
            embed.forward = original
        else:
            del embed.forward  # the class's own again
