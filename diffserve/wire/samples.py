"""A request's samples and the rows they take in a batch: the bookkeeping both engines share.

- :func:`chunks`: consecutive runs of a stacked batch (tensor, array or list), one per member;
- :func:`split_inputs` / :func:`input_arrays`: the input frames each work item carries, as arrays
  by their manifest (the frames were checked against it when the message was decoded);
- :func:`generators`: one generator per image, so each image depends on its own seed only;
- :func:`group_by`: members grouped by a key, in first-seen order (e.g. with or without a
  negative prompt);
- :func:`isolate`: run a batch, and where it raises, run it again in halves, down to single
  requests, so that only the request that causes an error fails.

Torch is imported only where a function needs it: the scheduler process uses this module too.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any, Callable, Hashable, Iterable, Sequence, TypeVar

from diffserve.wire.request import CONTROLS, REFERENCES, ImageRequest, WorkItem

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


def chunks(stacked: Any, sizes: Iterable[int]) -> list[Any]:
    """``stacked`` cut into consecutive runs of ``sizes`` rows; the sizes must add up to its
    length (a batch that does not line up with its members is a bug, not a rounding matter)."""
    parts, offset = [], 0
    for size in sizes:
        parts.append(stacked[offset:offset + size])
        offset += size
    if offset != len(stacked):
        raise ValueError(f"a batch of {len(stacked)} rows does not split into parts of {offset}")
    return parts


def split_inputs(items: Sequence[WorkItem], frames: list[Any]) -> list[list[Any]]:
    """The input frames of each item, which follow a work message's header item after item."""
    return chunks(frames, [len(item.manifest) for item in items])


def input_arrays(request: ImageRequest, frames: list[Any]) -> dict[str, Any]:
    """A request's input frames as uint8 arrays, each placed by its manifest entry: a task
    input under its pipeline keyword; an instruction edit's reference images as a list under
    ``references``; the control images under ``controls``, item c the image of control c."""
    import numpy as np

    arrays: dict[str, Any] = {}
    owned: dict[str, list] = {REFERENCES: [None] * request.references,
                              CONTROLS: [None] * len(request.controls)}
    for spec, frame in zip(request.manifest, frames):
        array = np.asarray(frame, np.uint8).reshape(spec.shape)
        if spec.role in owned:
            owned[spec.role][spec.owner] = array
        else:
            arrays[spec.role] = array
    if request.task_spec.references:
        arrays[REFERENCES] = owned[REFERENCES]
    if request.controls:
        arrays[CONTROLS] = owned[CONTROLS]
    return arrays


def generators(request: ImageRequest, start: int, stop: int) -> list:
    """One CPU generator per image ``start``..``stop-1``, seeded as the API promises (image i:
    seed + i). CPU generators draw the same noise on every device."""
    import torch

    return [torch.Generator("cpu").manual_seed(request.seed_of(i)) for i in range(start, stop)]


def group_by(members: Iterable[T], key: Callable[[T], Hashable]) -> dict[Hashable, list[T]]:
    groups: dict[Hashable, list[T]] = {}
    for member in members:
        groups.setdefault(key(member), []).append(member)
    return groups


def isolate(members: list[T], run: Callable[[list[T]], list[R]], group: Callable[[T], Hashable],
            what: str, on_error: Callable[[Exception], None] = lambda error: None,
            fatal: Callable[[Exception], bool] = lambda error: False,
            _depth: int = 0) -> list[tuple[T, R | Exception]]:
    """``run`` once over ``members`` (one result per member); if it raises, over each half of
    their groups in turn, and so on down to single groups, so that an error costs only the
    group that causes it while the rest keep running in as few calls as the error allows (an
    out-of-memory error splits a batch until it fits). ``run`` must have no effect that a retry
    would repeat. ``on_error`` sees each error before the retry (e.g. to free memory), once the
    failed attempt's frames are cleared: the retry runs outside the ``except`` block, so that
    nothing of that attempt (its activations, on a device that ran out of memory) is still
    alive. An error that ``fatal`` names (one no smaller batch can help) is raised as it is.
    Returns each member with its result or the error of its group."""
    try:
        return list(zip(members, checked(run(members), members)))
    except Exception as caught:  # noqa: BLE001 - find the culprit below
        if fatal(caught):
            raise
        error = caught
    traceback.clear_frames(error.__traceback__)
    error.__traceback__ = None
    on_error(error)
    groups = list(group_by(members, group).values())
    if len(groups) == 1:
        return [(m, error) for m in members]
    if _depth == 0:
        log.warning("%s failed for a batch of %d requests (%s: %s); splitting it to find the "
                    "cause", what, len(groups), type(error).__name__, error)
    half = len(groups) // 2
    return [pair for part in (groups[:half], groups[half:])
            for pair in isolate([m for g in part for m in g], run, group, what, on_error, fatal,
                                _depth + 1)]


def checked(results: list[R], members: list) -> list[R]:
    if len(results) != len(members):
        raise RuntimeError(f"{len(results)} results for {len(members)} members")
    return results
