"""The step cache's state (:mod:`diffserve.executor.accel.step_cache`): what each work item keeps
(:class:`UnitCache`), where its rows lie in one forward (:class:`CacheRows`), and one denoiser
call's decisions while it runs (:class:`CacheCall`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from diffserve.executor.tensors import nbytes

if TYPE_CHECKING:  # annotations only
    import torch


class UnitCache:
    """One work item's cache: per row, the signal and the cached tail at the last step its image
    computed; which denoiser made them; per image, the steps that reused them."""

    def __init__(self, images: int) -> None:
        self.signal: torch.Tensor | None = None
        self.tail: torch.Tensor | None = None
        self.owner: int | None = None
        self.cached = [0] * images

    @property
    def nbytes(self) -> int:
        return nbytes((self.signal, self.tail))

    def to(self, device) -> None:
        if self.signal is not None:
            self.signal, self.tail = self.signal.to(device), self.tail.to(device)


@dataclass
class CacheRows:
    """A work item in one forward: rows ``offset``..``offset + rows - 1`` of the call, ``images``
    images (with classifier-free guidance, the first half of its rows is unconditional)."""

    cache: UnitCache | None
    offset: int
    rows: int
    images: int
    threshold: float
    forced: bool  # this step computes whatever the signal says (warm-up)
    # Its own leading image tokens, in a forward whose rows of several sizes are padded to the
    # longest (None: the call's): its signal and cache cover those alone, so that they do not
    # depend on the padding, which changes with its batch-mates.
    tokens: int | None = None

    def own(self, tensor):
        """Its rows' part of a call's per-token ``tensor`` (rows first, tokens second)."""
        part = tensor[self.offset:self.offset + self.rows]
        return part if self.tokens is None else part[:, :self.tokens]

    def local_rows(self, image: int) -> list[int]:
        return [image, self.images + image] if self.rows > self.images else [image]


def cache_rows(cache: UnitCache | None, offset: int, rows: int, images: int, threshold: float,
               step: int, steps: int, force: bool = False, tokens: int | None = None) -> CacheRows:
    """``step`` of ``steps``: the first and the last always compute, and every step of a
    forward that ``force`` says must (one that carries ControlNet residuals, which the
    denoiser adds to every row between its blocks). ``tokens``: its own image tokens, where
    the forward's rows are padded."""
    return CacheRows(cache, offset, rows, images, threshold if cache is not None else 0.0,
                     force or step == 0 or step >= steps - 1, tokens)


@dataclass
class CacheCall:
    """One denoiser call inside a forward: its entries (rows renumbered to the call's)."""

    entries: list[CacheRows]
    rows: int
    tokens: int | None
    tracked: bool = False  # any entry may hit (a threshold above 0)
    miss: Any = None  # the rows that compute the remaining blocks (None: every row)
    miss_list: list[int] = field(default_factory=list)
    hits: list[tuple[CacheRows, int]] = field(default_factory=list)
    owner: int | None = None
    first_hidden: Any = None
    first_encoder: Any = None
    signal: Any = None
    commits: list[Callable[[], None]] = field(default_factory=list)
    parts: list["CacheCall"] = field(default_factory=list)  # split between denoisers (narrow)

    def __post_init__(self) -> None:
        self.tracked = any(e.threshold > 0 for e in self.entries)

    def hit_rows(self) -> int:
        return sum(len(e.local_rows(j)) for e, j in self.hits)
