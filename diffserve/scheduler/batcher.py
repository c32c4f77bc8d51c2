"""The waiting queue and its grouping rules: which waiting images go to an executor next.

A pure object: no sockets, no torch and no clock of its own (every method that needs the time
takes ``now``), so tests drive it with a fake clock.

Rules
- Size counts images: a request with ``n`` images is ``n`` samples, bounded by ``max_batch_size``;
  and cost (``request.cost`` per image, see :mod:`diffserve.costs`), bounded by
  ``max_batch_cost``. A request larger than the room left is split; its remaining images stay at
  its place in the queue.
- Requests are grouped by their signature in the engine's batching mode (the fields that mode
  cannot vary per sample; see :mod:`diffserve.protocol`).
- The oldest waiting request (the head) is always in the next group taken; the group is filled
  with later requests of the same signature in arrival order, skipping incompatible ones.
- A group that fills the room is ready at once. One that does not is ready once its oldest
  request has waited ``max_delay_s``, or when the caller forces it out (draining at shutdown).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

from diffserve.protocol import REQUEST_MODE, ImageRequest


@dataclass
class _Entry:
    request: ImageRequest
    enqueued_at: float
    signature: tuple
    next_index: int = 0  # first image of the request not yet handed out

    @property
    def remaining(self) -> int:
        return self.request.n - self.next_index

    def fitting(self, room: int, cost: float) -> int:
        """How many of its remaining images fit in ``room`` images and ``cost``."""
        if self.request.cost > 0 and cost < math.inf:
            room = min(room, math.floor(cost / self.request.cost + 1e-9))
        return max(0, min(room, self.remaining))


@dataclass(frozen=True)
class Slice:
    """Images ``start``..``stop-1`` of ``request``, taken together."""

    request: ImageRequest
    start: int
    stop: int
    enqueued_at: float

    @property
    def size(self) -> int:
        return self.stop - self.start


class Batcher:
    def __init__(self, max_batch_size: int, max_delay_s: float, mode: str = REQUEST_MODE,
                 max_batch_cost: float = math.inf) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
        self.max_batch_size = max_batch_size
        self.max_batch_cost = max_batch_cost
        self.max_delay_s = max_delay_s
        self.mode = mode
        # Arrival order over all requests, and per signature (same order), so that taking a
        # group costs O(group size) however long and mixed the queue is.
        self._queue: OrderedDict[str, _Entry] = OrderedDict()
        self._groups: dict[tuple, OrderedDict[str, _Entry]] = {}
        self._group_counts: dict[tuple, int] = {}
        self._group_cost: dict[tuple, float] = {}

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queue

    @property
    def waiting_image_count(self) -> int:
        return sum(self._group_counts.values())

    def add(self, request: ImageRequest, now: float) -> None:
        if request.request_id in self._queue:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        if request.n < 1:
            raise ValueError(f"request {request.request_id!r} asks for n={request.n} images")
        sig = request.signature(self.mode)
        entry = _Entry(request, now, sig)
        self._queue[request.request_id] = entry
        self._groups.setdefault(sig, OrderedDict())[request.request_id] = entry
        self._group_counts[sig] = self._group_counts.get(sig, 0) + request.n
        self._group_cost[sig] = self._group_cost.get(sig, 0.0) + request.n * request.cost

    def abort(self, request_id: str) -> bool:
        """Drop the request's images that have not been taken yet. True if it was waiting."""
        entry = self._queue.pop(request_id, None)
        if entry is None:
            return False
        self._unlink(entry)
        return True

    def waiting_ids(self) -> Iterator[str]:
        """Ids of waiting requests, oldest first."""
        return iter(self._queue)

    def head(self) -> tuple[tuple, float] | None:
        """(signature, enqueued_at) of the oldest waiting request; None when nothing waits."""
        entry = self._head()
        return None if entry is None else (entry.signature, entry.enqueued_at)

    def is_full(self, room: int | None = None, room_cost: float | None = None) -> bool:
        """Whether the head's group fills ``room`` images or ``room_cost`` (default: a whole
        batch)."""
        entry = self._head()
        if entry is None:
            return False
        sig = entry.signature
        return (self._group_counts[sig] >= (room or self.max_batch_size)
                or self._group_cost[sig] >= (room_cost or self.max_batch_cost))

    def time_until_ready(self, now: float, room: int | None = None,
                         room_cost: float | None = None) -> float | None:
        """Seconds until :meth:`next_batch` returns a group; None when nothing waits."""
        entry = self._head()
        if entry is None:
            return None
        if self.is_full(room, room_cost):
            return 0.0
        return max(0.0, entry.enqueued_at + self.max_delay_s - now)

    def next_batch(self, now: float, force: bool = False, room: int | None = None,
                   room_cost: float | None = None) -> list[Slice] | None:
        """Take the head's group, up to ``room`` images and ``room_cost``, if it is ready (or
        ``force``)."""
        entry = self._head()
        if entry is None:
            return None
        if not force and self.time_until_ready(now, room, room_cost) > 0:
            return None
        return self._take(entry.signature, room or self.max_batch_size,
                          room_cost or self.max_batch_cost) or None

    def take(self, signature: tuple, room: int, room_cost: float = math.inf) -> list[Slice] | None:
        """Take up to ``room`` images (and ``room_cost``) of the head's group at once, but only
        if the head has ``signature``: a running set may take company, never pass over the
        head. None if not even the head's next image fits."""
        entry = self._head()
        if entry is None or entry.signature != signature or entry.fitting(room, room_cost) < 1:
            return None
        return self._take(signature, room, room_cost)

    def take_group(self, signature: tuple, room: int, room_cost: float = math.inf) -> list[Slice] | None:
        """Like :meth:`take`, from the group of ``signature`` whatever the head's: only for a
        caller that keeps the head's room for it (see ``SchedulerCore._beside_head``)."""
        if not self.fits(signature, room, room_cost):
            return None
        return self._take(signature, room, room_cost)

    def fits(self, signature: tuple, room: int, room_cost: float) -> bool:
        """Whether the next image of the oldest waiting request of ``signature`` fits."""
        group = self._groups.get(signature)
        return bool(group) and next(iter(group.values())).fitting(room, room_cost) >= 1

    def head_image_cost(self) -> float:
        """What one more image of the head costs (0 when nothing waits)."""
        entry = self._head()
        return 0.0 if entry is None else entry.request.cost

    def signatures(self) -> list[tuple]:
        """The waiting signatures, by the arrival of each one's oldest request."""
        return sorted(self._groups, key=lambda sig: next(iter(self._groups[sig].values())).enqueued_at)

    def _take(self, sig: tuple, room: int, room_cost: float) -> list[Slice]:
        left, left_cost = room, room_cost
        taken: list[Slice] = []
        finished: list[_Entry] = []
        for entry in self._groups[sig].values():  # arrival order; stops once the room is used
            count = entry.fitting(left, left_cost)
            if count == 0:
                break  # what follows waits its turn: the group keeps its order
            taken.append(Slice(entry.request, entry.next_index, entry.next_index + count,
                               entry.enqueued_at))
            entry.next_index += count
            left -= count
            left_cost -= count * entry.request.cost
            self._group_counts[sig] -= count
            self._group_cost[sig] -= count * entry.request.cost
            if entry.remaining == 0:
                finished.append(entry)
            if left == 0:
                break
        for entry in finished:
            del self._queue[entry.request.request_id]
            self._unlink(entry, remaining=0)
        return taken

    def _head(self) -> _Entry | None:
        for entry in self._queue.values():
            return entry
        return None

    def _unlink(self, entry: _Entry, remaining: int | None = None) -> None:
        sig = entry.signature
        group = self._groups[sig]
        del group[entry.request.request_id]
        if remaining is None:
            self._group_counts[sig] -= entry.remaining
            self._group_cost[sig] -= entry.remaining * entry.request.cost
        if not group:
            del self._groups[sig]
            del self._group_counts[sig]
            del self._group_cost[sig]
