"""The dynamic batcher: which waiting images go into the next pipeline call.

A pure object: no sockets, no torch and no clock of its own (every method that needs the time
takes ``now``), so tests drive it with a fake clock.

Rules
- Size counts images: a request with ``n`` images is ``n`` samples. A request larger than the
  room left is split; its remaining images stay at its place in the queue.
- The oldest waiting request (the head) is always in the next batch; the batch is filled with
  later requests of the same signature in arrival order, skipping incompatible ones.
- A full batch is ready at once. One that is not full is ready once its oldest request has waited
  ``max_delay_s``, or when the caller forces it out (e.g. draining at shutdown).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from diffserve.protocol import GenerationRequest


@dataclass
class _Entry:
    request: GenerationRequest
    enqueued_at: float
    signature: tuple
    next_index: int = 0  # first image of the request not yet handed to a batch

    @property
    def remaining(self) -> int:
        return self.request.n - self.next_index


@dataclass(frozen=True)
class Slice:
    """Images ``start``..``stop-1`` of ``request``, taken into one batch."""

    request: GenerationRequest
    start: int
    stop: int
    enqueued_at: float

    @property
    def size(self) -> int:
        return self.stop - self.start


class Batcher:
    def __init__(self, max_batch_size: int, max_delay_s: float) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        # Arrival order over all requests, and per signature (same order), so that building a
        # batch costs O(batch size) however long and mixed the queue is.
        self._queue: OrderedDict[str, _Entry] = OrderedDict()
        self._groups: dict[tuple, OrderedDict[str, _Entry]] = {}
        self._group_images: dict[tuple, int] = {}

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queue

    @property
    def waiting_images(self) -> int:
        return sum(self._group_images.values())

    def add(self, request: GenerationRequest, now: float) -> None:
        if request.request_id in self._queue:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        if request.n < 1:
            raise ValueError(f"request {request.request_id!r} asks for n={request.n} images")
        sig = request.batch_signature()
        entry = _Entry(request, now, sig)
        self._queue[request.request_id] = entry
        self._groups.setdefault(sig, OrderedDict())[request.request_id] = entry
        self._group_images[sig] = self._group_images.get(sig, 0) + request.n

    def abort(self, request_id: str) -> bool:
        """Drop the request's images that have not been batched yet. True if it was waiting."""
        entry = self._queue.pop(request_id, None)
        if entry is None:
            return False
        self._unlink(entry)
        return True

    def waiting_ids(self):
        """Ids of waiting requests, oldest first."""
        return iter(self._queue)

    def time_until_ready(self, now: float) -> float | None:
        """Seconds until :meth:`next_batch` returns a batch; None when nothing waits."""
        head = self._head()
        if head is None:
            return None
        if self._group_images[head.signature] >= self.max_batch_size:
            return 0.0
        return max(0.0, head.enqueued_at + self.max_delay_s - now)

    def next_batch(self, now: float, force: bool = False) -> list[Slice] | None:
        """Take the next batch if it is ready (or ``force``); None otherwise."""
        head = self._head()
        if head is None:
            return None
        if not force and self.time_until_ready(now) > 0:
            return None
        sig = head.signature
        room = self.max_batch_size
        taken: list[Slice] = []
        finished: list[_Entry] = []
        for entry in self._groups[sig].values():  # arrival order; stops once the batch is full
            count = min(room, entry.remaining)
            taken.append(Slice(entry.request, entry.next_index, entry.next_index + count,
                               entry.enqueued_at))
            entry.next_index += count
            room -= count
            if entry.remaining == 0:
                finished.append(entry)
            if room == 0:
                break
        self._group_images[sig] -= self.max_batch_size - room
        for entry in finished:
            del self._queue[entry.request.request_id]
            self._unlink(entry, images_left=0)
        return taken

    def _head(self) -> _Entry | None:
        for entry in self._queue.values():
            return entry
        return None

    def _unlink(self, entry: _Entry, images_left: int | None = None) -> None:
        sig = entry.signature
        group = self._groups[sig]
        del group[entry.request.request_id]
        if images_left is None:
            self._group_images[sig] -= entry.remaining
        if not group:
            del self._groups[sig]
            del self._group_images[sig]
