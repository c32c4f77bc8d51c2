"""Some rows of a batch, as the cheapest thing that indexes them: a slice where they are
contiguous (a view, no copy), else an index tensor. The step cache (rows that missed) and the
per-row adapters (rows of one adapter) both take, and put back, a part of a forward's rows."""

from __future__ import annotations

import torch

Rows = slice | torch.Tensor


def selection(rows: list[int] | None, device) -> Rows:
    """``rows`` (None: all of them) as a slice or an index tensor on ``device``."""
    if rows is None:
        return slice(None)
    if rows and rows == list(range(rows[0], rows[-1] + 1)):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, device=device, dtype=torch.long)


def take(rows: Rows, tensor: torch.Tensor) -> torch.Tensor:
    """Those rows of ``tensor`` (dim 0)."""
    return tensor[rows] if isinstance(rows, slice) else tensor.index_select(0, rows)


def put(full: torch.Tensor, rows: Rows, part: torch.Tensor) -> torch.Tensor:
    """``part`` written into those rows of ``full``, in place; ``full``."""
    if isinstance(rows, slice):
        full[rows] = part
        return full
    return full.index_copy_(0, rows, part)
