"""Rows of a batched forward: some of them as the cheapest thing that indexes them (a slice
where they are contiguous, a view and no copy; else an index tensor), and which of a forward's
rows a denoiser call carries (:class:`RowScope`).

The step cache (rows that missed) and the per-row adapters (rows of one adapter) both take, and
put back, a part of a forward's rows. Per-row machinery (each row's LoRA stack, each image's step
cache) is told a forward's rows when the forward starts; a family that splits one forward between
denoisers (Wan 2.2's two experts) narrows the scope around each call, so that machinery follows
it::

    with family.row_scope.narrow(index):  # the rows of ``index``, in that order
        part = expert(latents[index], ...)
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

Rows = slice | torch.Tensor


def selection(rows: list[int] | None, device) -> Rows:
    """``rows`` (None: all of them) as a slice or an index tensor on ``device``. On a GPU the
    index goes up from pinned memory without blocking: a copy from ordinary host memory would
    wait for the device to finish what it was given (a Python list as an index does the same)."""
    if rows is None:
        return slice(None)
    if rows and rows == list(range(rows[0], rows[-1] + 1)):
        return slice(rows[0], rows[-1] + 1)
    return on_device(rows, device)


def on_device(values: list, device, dtype=torch.long) -> torch.Tensor:
    """A tensor of host ``values`` on ``device``, sent without waiting for the device: from
    pinned memory on a GPU (``torch.tensor(values, device=...)`` copies from ordinary host
    memory, which waits for everything the device was given before)."""
    tensor = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def add(full: torch.Tensor, rows: Rows, part: torch.Tensor) -> torch.Tensor:
    """``part`` added to those rows of ``full``, in place; ``full``."""
    if isinstance(rows, slice):
        full[rows] += part
        return full
    return full.index_add_(0, rows, part)


def take(rows: Rows, tensor: torch.Tensor) -> torch.Tensor:
    """Those rows of ``tensor`` (dim 0)."""
    return tensor[rows] if isinstance(rows, slice) else tensor.index_select(0, rows)


def put(full: torch.Tensor, rows: Rows, part: torch.Tensor) -> torch.Tensor:
    """``part`` written into those rows of ``full``, in place; ``full``."""
    if isinstance(rows, slice):
        full[rows] = part
        return full
    return full.index_copy_(0, rows, part)


class RowScope:
    def __init__(self) -> None:
        self._listeners: list[Callable[[list[int]], Any]] = []

    def listen(self, narrow: Callable[[list[int]], Any]) -> None:
        """``narrow(rows)`` gives a context within which the listener sees only ``rows``."""
        self._listeners.append(narrow)

    @contextmanager
    def narrow(self, index: Sequence[int]) -> Iterator[None]:
        rows = [int(i) for i in index]
        with ExitStack() as stack:
            for narrow in self._listeners:
                stack.enter_context(narrow(rows))
            yield
