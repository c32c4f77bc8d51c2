"""The waiting queue and its grouping rules: which waiting images go to an executor next.

A pure object: no sockets, no torch and no clock of its own (every method that needs the time
takes ``now``), so tests drive it with a fake clock.

Rules
- Size counts images: a request with ``n`` images is ``n`` samples, bounded by ``max_batch_size``;
  and cost (``request.cost`` per image, see :mod:`diffserve.costs`), bounded by
  ``max_batch_cost``. A request larger than the room left is split; its remaining images stay at
  its place in the queue.
- Requests are grouped by their batch key in the engine's batching mode (the fields that mode
  cannot vary per sample; see :mod:`diffserve.protocol`), computed once here when a request
  enters and carried from then on (:class:`Slice`, then the work item).
- The queue is ordered by a queue policy (:mod:`diffserve.policies`; first come, first served
  by default). Its first request (the head) is always in the next group taken; the group is
  filled with later requests of the same batch key in queue order, skipping incompatible ones.
- A group that fills the room is ready at once. One that does not is ready once its head has
  waited ``max_delay_s``, or when the caller forces it out (draining at shutdown).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Protocol

from diffserve.policies import QueuePolicy
from diffserve.policies.fcfs import FirstCome
from diffserve.protocol import REQUEST_MODE, ImageRequest


class AdapterRoom(Protocol):
    """Adapter slots left for what a group takes (see :mod:`diffserve.scheduler.slots`)."""

    def fits(self, loras) -> bool: ...

    def take(self, loras) -> None: ...


@dataclass
class _Entry:
    request: ImageRequest
    enqueued_at: float
    batch_key: tuple
    rank: tuple  # its place in the queue (the queue policy's rank, then arrival)
    next_index: int = 0  # first image of the request not yet handed out

    @property
    def remaining(self) -> int:
        return self.request.n - self.next_index

    def fitting(self, room: int, cost: float, adapters: AdapterRoom | None = None) -> int:
        """How many of its remaining images fit in ``room`` images and ``cost`` (none if its
        adapters do not fit)."""
        if adapters is not None and not adapters.fits(self.request.loras):
            return 0
        if self.request.cost > 0 and cost < math.inf:
            room = min(room, math.floor(cost / self.request.cost + 1e-9))
        return max(0, min(room, self.remaining))


class _Ordered:
    """Entries kept sorted by rank: the first, removal and iteration in order."""

    def __init__(self) -> None:
        self._ranks: list[tuple] = []
        self._entries: dict[tuple, _Entry] = {}

    def add(self, entry: _Entry) -> None:
        bisect.insort(self._ranks, entry.rank)
        self._entries[entry.rank] = entry

    def remove(self, entry: _Entry) -> None:
        del self._ranks[bisect.bisect_left(self._ranks, entry.rank)]
        del self._entries[entry.rank]

    def first(self) -> _Entry | None:
        return self._entries[self._ranks[0]] if self._ranks else None

    def __iter__(self) -> Iterator[_Entry]:
        return (self._entries[rank] for rank in self._ranks)

    def __bool__(self) -> bool:
        return bool(self._ranks)


@dataclass(frozen=True)
class Slice:
    """Images ``start``..``stop-1`` of ``request``, taken together."""

    request: ImageRequest
    start: int
    stop: int
    enqueued_at: float
    batch_key: tuple = ()

    @property
    def size(self) -> int:
        return self.stop - self.start


class Batcher:
    def __init__(self, max_batch_size: int, max_delay_s: float, mode: str = REQUEST_MODE,
                 max_batch_cost: float = math.inf, policy: QueuePolicy | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
        self.max_batch_size = max_batch_size
        self.max_batch_cost = max_batch_cost
        self.max_delay_s = max_delay_s
        self.mode = mode
        self.policy = policy or FirstCome()
        self._arrivals = itertools.count()  # ties of rank go by arrival
        # Arrival order over all requests (for expiry), queue order over all and per batch key,
        # so that taking a group costs O(group size) however long and mixed the queue is.
        self._queue: OrderedDict[str, _Entry] = OrderedDict()
        self._order = _Ordered()
        self._groups: dict[tuple, _Ordered] = {}
        self._group_counts: dict[tuple, int] = {}
        self._group_cost: dict[tuple, float] = {}

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queue

    @property
    def waiting_image_count(self) -> int:
        return sum(self._group_counts.values())

    def add(self, request: ImageRequest, now: float) -> tuple:
        """Queue ``request``; its batch key (what it must share with the requests it runs with)."""
        if request.request_id in self._queue:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        if request.n < 1:
            raise ValueError(f"request {request.request_id!r} asks for n={request.n} images")
        key = request.batch_key(self.mode)
        entry = _Entry(request, now, key, (*self.policy.rank(request, now), next(self._arrivals)))
        self._queue[request.request_id] = entry
        self._order.add(entry)
        self._groups.setdefault(key, _Ordered()).add(entry)
        self._group_counts[key] = self._group_counts.get(key, 0) + request.n
        self._group_cost[key] = self._group_cost.get(key, 0.0) + request.n * request.cost
        return key

    def abort(self, request_id: str) -> bool:
        """Drop the request's images that have not been taken yet. True if it was waiting."""
        entry = self._queue.pop(request_id, None)
        if entry is None:
            return False
        self._unlink(entry)
        return True

    def waiting_ids(self) -> Iterator[str]:
        """Ids of waiting requests, oldest first (whatever the queue order)."""
        return iter(self._queue)

    def head(self) -> tuple[tuple, float] | None:
        """(batch key, enqueued_at) of the head; None when nothing waits."""
        entry = self._order.first()
        return None if entry is None else (entry.batch_key, entry.enqueued_at)

    def head_id(self) -> str | None:
        entry = self._order.first()
        return None if entry is None else entry.request.request_id

    def head_request(self) -> ImageRequest | None:
        entry = self._order.first()
        return None if entry is None else entry.request

    def is_full(self, room: int | None = None, room_cost: float | None = None) -> bool:
        """Whether the head's group fills ``room`` images or ``room_cost`` (default: a whole
        batch)."""
        entry = self._order.first()
        if entry is None:
            return False
        key = entry.batch_key
        return (self._group_counts[key] >= (room or self.max_batch_size)
                or self._group_cost[key] >= (room_cost or self.max_batch_cost))

    def time_until_ready(self, now: float, room: int | None = None,
                         room_cost: float | None = None) -> float | None:
        """Seconds until :meth:`next_batch` returns a group; None when nothing waits."""
        entry = self._order.first()
        if entry is None:
            return None
        if self.is_full(room, room_cost):
            return 0.0
        return max(0.0, entry.enqueued_at + self.max_delay_s - now)

    def next_batch(self, now: float, force: bool = False, room: int | None = None,
                   room_cost: float | None = None,
                   adapters: AdapterRoom | None = None) -> list[Slice] | None:
        """Take the head's group, up to ``room`` images and ``room_cost``, if it is ready (or
        ``force``)."""
        entry = self._order.first()
        if entry is None:
            return None
        if not force and self.time_until_ready(now, room, room_cost) > 0:
            return None
        return self._take(entry.batch_key, room or self.max_batch_size,
                          room_cost or self.max_batch_cost, adapters) or None

    def take(self, batch_key: tuple, room: int, room_cost: float = math.inf,
             adapters: AdapterRoom | None = None) -> list[Slice] | None:
        """Take up to ``room`` images (and ``room_cost``) of the head's group at once, but only
        if the head has ``batch_key``: a running set may take company, never pass over the
        head. None if not even the head's next image fits."""
        entry = self._order.first()
        if (entry is None or entry.batch_key != batch_key
                or entry.fitting(room, room_cost, adapters) < 1):
            return None
        return self._take(batch_key, room, room_cost, adapters)

    def take_group(self, batch_key: tuple, room: int, room_cost: float = math.inf,
                   adapters: AdapterRoom | None = None) -> list[Slice] | None:
        """Like :meth:`take`, from the group of ``batch_key`` whatever the head's: only for a
        caller that keeps the head's room for it (see ``SchedulerCore._beside_head``)."""
        if not self.fits(batch_key, room, room_cost, adapters):
            return None
        return self._take(batch_key, room, room_cost, adapters)

    def fits(self, batch_key: tuple, room: int, room_cost: float,
             adapters: AdapterRoom | None = None) -> bool:
        """Whether the next image of the first waiting request of ``batch_key`` fits."""
        group = self._groups.get(batch_key)
        return bool(group) and group.first().fitting(room, room_cost, adapters) >= 1

    def head_image_cost(self) -> float:
        """What one more image of the head costs (0 when nothing waits)."""
        entry = self._order.first()
        return 0.0 if entry is None else entry.request.cost

    def batch_keys(self) -> list[tuple]:
        """The waiting batch keys, in the queue order of each one's first request."""
        return sorted(self._groups, key=lambda key: self._groups[key].first().rank)

    def _take(self, key: tuple, room: int, room_cost: float,
              adapters: AdapterRoom | None) -> list[Slice]:
        left, left_cost = room, room_cost
        taken: list[Slice] = []
        finished: list[_Entry] = []
        for entry in self._groups[key]:  # queue order; stops once the room is used
            count = entry.fitting(left, left_cost, adapters)
            if count == 0:
                break  # what follows waits its turn: the group keeps its order
            taken.append(Slice(entry.request, entry.next_index, entry.next_index + count,
                               entry.enqueued_at, key))
            if adapters is not None:
                adapters.take(entry.request.loras)
            entry.next_index += count
            left -= count
            left_cost -= count * entry.request.cost
            self._group_counts[key] -= count
            self._group_cost[key] -= count * entry.request.cost
            if entry.remaining == 0:
                finished.append(entry)
            if left == 0:
                break
        for entry in finished:
            del self._queue[entry.request.request_id]
            self._unlink(entry, remaining=0)
        return taken

    def _unlink(self, entry: _Entry, remaining: int | None = None) -> None:
        key = entry.batch_key
        group = self._groups[key]
        group.remove(entry)
        self._order.remove(entry)
        if remaining is None:
            self._group_counts[key] -= entry.remaining
            self._group_cost[key] -= entry.remaining * entry.request.cost
        if not group:
            del self._groups[key]
            del self._group_counts[key]
            del self._group_cost[key]
