"""What a family declares and does for rows of different sizes in one forward
(:mod:`~diffserve.executor.families.row_sizes`), mixed into
:class:`~diffserve.executor.families.base.Family` as ControlNet's hooks are."""

from __future__ import annotations

from typing import ClassVar


class SizeHooks:
    name: ClassVar[str]
    # Whether rows of different sizes share one forward (a transformer's rows are token
    # sequences: diffserve.executor.families.row_sizes); else one running set per size.
    mixes_sizes: ClassVar[bool] = False
    # Whether it pads them to one grid (the tallest's height by the widest's width: families that
    # patchify at their first layer, diffserve.executor.families.patched_rows), not to the
    # longest row's tokens; admission prices the padding by the same rule.
    mixes_in_grid: ClassVar[bool] = False
    # Whether its edits (reference images' tokens beside each row's own) mix sizes too.
    mixes_references: ClassVar[bool] = False
    # Whether requests with ControlNet controls mix sizes too (the control models' forward).
    mixes_controls: ClassVar[bool] = False

    def row_tokens(self, latents) -> int:
        """A row's image tokens in its latents (a UNet's: its latent cells)."""
        cells = 1
        for side in latents.shape[2:]:
            cells *= side
        return cells

    def padded_tokens(self, latents: list) -> int:
        """The tokens each row of a forward over ``latents`` (each unit's) computes: the most
        any has, or, where rows are laid out in one grid, the grid's (in row_tokens' unit)."""
        if not self.mixes_in_grid:
            return max(self.row_tokens(x) for x in latents)
        cells = own = 1
        for axis in range(2, latents[0].dim()):
            cells *= max(x.shape[axis] for x in latents)
            own *= latents[0].shape[axis]
        return cells * self.row_tokens(latents[0]) // own

    def row_processors(self) -> tuple[type, ...]:
        """The attention processors a mixed forward stands its per-row ones in for (a family's
        ``rows.kinds()``; none where it needs none)."""
        return ()

    def mixes_sizes_now(self) -> str | None:
        """Why rows of different sizes cannot share a forward of the model as loaded (None:
        they can): a family that does not mix them, or a denoiser whose attention runs a
        processor the family's per-row one cannot stand in for (an IP-Adapter's, a user's)."""
        from diffserve.executor.families.row_sizes import foreign_processors

        if not self.mixes_sizes:
            return f"{self.name} runs one size a forward"
        kinds = self.row_processors()
        foreign = sorted({p for denoiser in (self.denoisers if kinds else ())
                          for p in foreign_processors(denoiser, kinds)})
        return (f"its attention runs {', '.join(foreign)}, which a forward of several sizes "
                "cannot stand in for" if foreign else None)

    @staticmethod
    def _longest(sizes) -> tuple[int, int]:
        """The size of a mixed forward's row with the most tokens."""
        return sizes.sizes[sizes.tokens.index(max(sizes.tokens))]
