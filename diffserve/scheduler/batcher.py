"""The waiting queue and its grouping rules: which waiting images go to an executor next.

A pure object: no sockets, no torch and no clock of its own (every method that needs the time
takes ``now``), so tests drive it with a fake clock.

Rules
- Size counts images: a request with ``n`` images is ``n`` samples, bounded by ``max_batch_size``;
  and cost (``request.cost`` per image, see :mod:`diffserve.wire.costs`), bounded by
  ``max_batch_cost``. A request larger than the room left is split; its remaining images stay at
  its place in the queue.
- Requests are grouped by their batch key in the batching mode of their task (the fields that
  mode cannot vary per sample; see :mod:`diffserve.wire.protocol`), computed once here when a request
  enters and carried from then on (:class:`Slice`, then the work item). A task the step engine
  does not run on this model is in request mode while the others are in step mode.
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
from typing import Iterator

from diffserve.policies import QueuePolicy
from diffserve.policies.fcfs import FirstCome
from diffserve.wire.model_info import mode_for
from diffserve.wire.protocol import REQUEST_MODE, key_mode
from diffserve.wire.request import ImageRequest
from diffserve.scheduler.slots import Seat


@dataclass
class _Entry:
    request: ImageRequest
    enqueued_at: float
    batch_key: tuple
    rank: tuple  # its place in the queue (the queue policy's rank, then arrival)
    next_index: int = 0  # first image of the request not yet handed out
    stop: int | None = None  # a paused item: its images end here (else the request's n)
    pinned: int | None = None  # a paused item: the executor that holds its state
    key: str = ""  # its place in the queue's index: the request id, or the paused item's key

    def __post_init__(self) -> None:
        self.key = self.request.request_id if self.pinned is None else paused_key(
            self.request.request_id, self.next_index)

    @property
    def remaining(self) -> int:
        return (self.request.n if self.stop is None else self.stop) - self.next_index

    def fitting(self, room: int, cost: float, seat: Seat | None = None) -> int:
        """How many of its remaining images fit in ``room`` images and ``cost`` (none if the
        seat does not admit it; a paused item all or none)."""
        if seat is not None and not seat.admits(self.request, self.pinned):
            return 0
        if self.request.cost > 0 and cost < math.inf:
            room = min(room, math.floor(cost / self.request.cost + 1e-9))
        if seat is not None:
            room = min(room, seat.images(self.request))
        count = max(0, min(room, self.remaining))
        return count if self.pinned is None or count == self.remaining else 0


def paused_key(request_id: str, start: int) -> str:
    return f"{request_id}#{start}"


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
    """Images ``start``..``stop-1`` of ``request``, taken together (``resume``: a paused item
    going back into its executor's running set)."""

    request: ImageRequest
    start: int
    stop: int
    enqueued_at: float
    batch_key: tuple = ()
    resume: bool = False

    @property
    def size(self) -> int:
        return self.stop - self.start


class Batcher:
    def __init__(self, max_batch_size: int, max_delay_s: float, mode: str = REQUEST_MODE,
                 max_batch_cost: float = math.inf, policy: QueuePolicy | None = None,
                 task_modes: dict[str, str] | None = None,
                 mixed_sizes: frozenset[str] = frozenset()) -> None:
        """``mode``: the executors' mode; ``task_modes``: tasks whose mode differs from it;
        ``mixed_sizes``: the mode keys whose requests of different sizes share a forward (their
        key leaves the size out)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
        self.max_batch_size = max_batch_size
        self.max_batch_cost = max_batch_cost
        self.max_delay_s = max_delay_s
        self.mode = mode
        self.task_modes = task_modes or {}
        self.mixed_sizes = frozenset(mixed_sizes)
        self.policy = policy or FirstCome()
        self._arrivals = itertools.count()  # ties of rank go by arrival
        # Arrival order over all requests (for expiry), queue order over all and per batch key,
        # so that taking a group costs O(group size) however long and mixed the queue is.
        self._queue: OrderedDict[str, _Entry] = OrderedDict()
        self._order = _Ordered()
        self._groups: dict[tuple, _Ordered] = {}
        self._group_counts: dict[tuple, int] = {}
        self._group_cost: dict[tuple, float] = {}
        self._paused: dict[str, set[str]] = {}  # request id -> its paused items' keys

    def __len__(self) -> int:
        """Requests waiting to start (paused items aside)."""
        return len(self._queue) - self.paused_count

    @property
    def paused_count(self) -> int:
        return sum(map(len, self._paused.values()))

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
        key = request.batch_key(key_mode(self.mode_of(request.mode_key),
                                         request.mode_key in self.mixed_sizes))
        self._link(_Entry(request, now, key, (*self.policy.rank(request, now),
                                              next(self._arrivals))))
        return key

    def mode_of(self, key: str) -> str:
        """The batching mode a request's mode key (its task, with or without controls) runs in:
        its own where it has one, else its task's."""
        return mode_for(self.task_modes, key, self.mode)

    def mixes_sizes(self, batch_key: tuple) -> bool:
        """Whether the waiting group of ``batch_key`` is of a task whose sizes share a forward."""
        group = self._groups.get(batch_key)
        return (bool(group) and self.mode_of(group.first().request.mode_key) != REQUEST_MODE
                and group.first().request.mode_key in self.mixed_sizes)

    def is_call(self, batch_key: tuple) -> bool:
        """Whether the waiting group of ``batch_key`` runs as whole pipeline calls (request mode)
        on executors that run the step engine."""
        group = self._groups.get(batch_key)
        return (bool(group) and self.mode != REQUEST_MODE
                and self.mode_of(group.first().request.mode_key) == REQUEST_MODE)

    def add_paused(self, request: ImageRequest, start: int, stop: int, batch_key: tuple,
                   enqueued_at: float, executor: int) -> None:
        """Queue images ``start``..``stop-1`` of a request paused on ``executor``: at the rank its
        request had (ahead of newer requests of its class), taken only as a whole and only by
        that executor, which holds its state."""
        entry = _Entry(request, enqueued_at, batch_key,
                       (*self.policy.rank(request, enqueued_at), next(self._arrivals)),
                       start, stop, executor)
        self._paused.setdefault(request.request_id, set()).add(entry.key)
        self._link(entry)

    def unpause(self, request_id: str, start: int) -> bool:
        """Drop a paused item that ended meanwhile (its executor finished it before the pause
        reached it). Whether it was queued."""
        key = paused_key(request_id, start)
        entry = self._queue.pop(key, None)
        if entry is None:
            return False
        self._unlink(entry)
        return True

    def _link(self, entry: _Entry) -> None:
        key, request = entry.batch_key, entry.request
        self._queue[entry.key] = entry
        self._order.add(entry)
        self._groups.setdefault(key, _Ordered()).add(entry)
        self._group_counts[key] = self._group_counts.get(key, 0) + entry.remaining
        self._group_cost[key] = self._group_cost.get(key, 0.0) + entry.remaining * request.cost

    def abort(self, request_id: str) -> bool:
        """Drop the request's images that have not been taken yet (its paused items too). True
        if it was waiting."""
        keys = [request_id, *self._paused.get(request_id, ())]
        entries = [e for e in map(self._queue.pop, keys, [None] * len(keys)) if e is not None]
        for entry in entries:
            self._unlink(entry)
        return bool(entries)

    def waiting_ids(self) -> Iterator[str]:
        """Ids of requests waiting to start, oldest first (whatever the queue order)."""
        return (key for key, entry in self._queue.items() if entry.pinned is None)

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
                   room_cost: float | None = None, seat: Seat | None = None) -> list[Slice] | None:
        """Take the head's group, up to ``room`` images and ``room_cost``, if it is ready (or
        ``force``)."""
        entry = self._order.first()
        if entry is None:
            return None
        if not force and self.time_until_ready(now, room, room_cost) > 0:
            return None
        return self._take(entry.batch_key, room or self.max_batch_size,
                          room_cost or self.max_batch_cost, seat) or None

    def take(self, batch_key: tuple, room: int, room_cost: float = math.inf,
             seat: Seat | None = None) -> list[Slice] | None:
        """Take up to ``room`` images (and ``room_cost``) of the head's group at once, but only
        if the head has ``batch_key``: a running set may take company, never pass over the
        head. None if not even the head's next image fits."""
        entry = self._order.first()
        if (entry is None or entry.batch_key != batch_key
                or entry.fitting(room, room_cost, seat) < 1):
            return None
        return self._take(batch_key, room, room_cost, seat)

    def take_group(self, batch_key: tuple, room: int, room_cost: float = math.inf,
                   seat: Seat | None = None) -> list[Slice] | None:
        """Like :meth:`take`, from the group of ``batch_key`` whatever the head's: only for a
        caller that keeps the head's room for it (see ``SchedulerCore._beside_head``)."""
        if not self.fits(batch_key, room, room_cost, seat):
            return None
        return self._take(batch_key, room, room_cost, seat)

    def fits(self, batch_key: tuple, room: int, room_cost: float, seat: Seat | None = None) -> bool:
        """Whether the next image of the first waiting request of ``batch_key`` fits."""
        group = self._groups.get(batch_key)
        return bool(group) and group.first().fitting(room, room_cost, seat) >= 1

    def head_image_cost(self) -> float:
        """What one more image of the head costs (0 when nothing waits)."""
        entry = self._order.first()
        return 0.0 if entry is None else entry.request.cost

    def batch_keys(self) -> list[tuple]:
        """The waiting batch keys, in the queue order of each one's first request."""
        return sorted(self._groups, key=lambda key: self._groups[key].first().rank)

    def _take(self, key: tuple, room: int, room_cost: float, seat: Seat | None) -> list[Slice]:
        left, left_cost = room, room_cost
        taken: list[Slice] = []
        finished: list[_Entry] = []
        for entry in self._groups[key]:  # queue order; stops once the room is used
            count = entry.fitting(left, left_cost, seat)
            if count == 0:
                break  # what follows waits its turn: the group keeps its order
            taken.append(Slice(entry.request, entry.next_index, entry.next_index + count,
                               entry.enqueued_at, key, resume=entry.pinned is not None))
            if seat is not None:
                seat.take(entry.request, count)
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
            del self._queue[entry.key]
            self._unlink(entry, remaining=0)
        return taken

    def _unlink(self, entry: _Entry, remaining: int | None = None) -> None:
        if entry.pinned is not None:
            paused = self._paused[entry.request.request_id]
            paused.discard(entry.key)
            if not paused:
                del self._paused[entry.request.request_id]
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
