"""Some rows of a batch, as the cheapest thing that indexes them: a slice where they are
contiguous (a view, no copy), else an index tensor. The step cache (rows that missed) and the
per-row adapters (rows of one adapter) both take, and put back, a part of a forward's rows."""

from __future__ import annotations

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
    index = torch.tensor(rows, dtype=torch.long)
    if torch.device(device).type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


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
