"""Scheduler logic: the single owner of request state.

No sockets, no torch, no clock: the process wrapper (:mod:`diffserve.scheduler.process`) feeds
it messages and the time, and sends what it returns. That keeps every rule here testable in place.

One queue feeds every executor. Each executor has a slot: the items it holds (sent and not yet
answered) and, while it holds any, their signature. Placement:

- **request mode**: a batch goes to an idle executor once the batcher says it is ready (full, or
  its oldest request waited the delay, or the server is draining).
- **step mode**: an executor whose running set has the head's signature and room takes the head
  and its compatible followers at once ("join"); an empty executor starts a new set by the same
  rules as a batch. When the head fits no executor, nothing is admitted anywhere: the running
  sets drain until one can take it, so the head never starves.
- Among the executors that can take the head, the least loaded one gets it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from diffserve.protocol import (
    REQUEST_MODE,
    STEP_MODE,
    Cancel,
    ImageRequest,
    ItemsDone,
    RequestDone,
    RequestFailed,
    Work,
    WorkItem,
)
from diffserve.scheduler.batcher import Batcher, Slice

# Why a batch (request mode) or an admission (step mode) left the queue.
FULL, DELAY, EXECUTOR_FREE, DRAIN, JOIN = "full", "delay", "executor_free", "drain", "join"
DISPATCH_REASONS = (FULL, DELAY, EXECUTOR_FREE, DRAIN, JOIN)


@dataclass
class _Tracked:
    request: ImageRequest
    frames: list[Any]  # input pixels (edits), forwarded with every item of the request
    enqueued_at: float
    first_dispatch_at: float | None = None
    images: dict[int, Any] = field(default_factory=dict)  # index -> raw frame
    execution_s: float = 0.0  # pipeline time of the items that made its images, summed
    prompt_tokens: int = 0


@dataclass
class ExecutorSlot:
    index: int
    ready: bool = False
    items: dict[tuple[str, int], WorkItem] = field(default_factory=dict)
    images: int = 0
    signature: tuple | None = None
    free_since: float = 0.0  # when it last had nothing to do

    def holds(self, request_id: str) -> bool:
        return any(key[0] == request_id for key in self.items)


@dataclass(frozen=True)
class Dispatch:
    """Work to send to one executor, with figures for the metrics."""

    executor: int
    work: Work
    frames: list[Any]
    reason: str
    queue_times_s: list[float]  # one per request dispatched for the first time


@dataclass(frozen=True)
class Finished:
    """A final answer for the frontend: ``done`` with its frames, or ``failed``."""

    done: RequestDone | None = None
    frames: list[Any] = field(default_factory=list)
    failed: RequestFailed | None = None
    execution_s: float | None = None  # with ``done``: time of the calls that made its images

    @property
    def request_id(self) -> str:
        return (self.done or self.failed).request_id


class SchedulerCore:
    def __init__(self, max_batch_size: int, max_delay_s: float, num_executors: int = 1,
                 max_queue_size: int = 0, request_timeout_s: float = 0.0,
                 mode: str = REQUEST_MODE) -> None:
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.max_queue_size = max_queue_size  # 0: unbounded
        self.request_timeout_s = request_timeout_s  # 0: none
        self.batcher = Batcher(max_batch_size, max_delay_s, mode)
        self.slots = [ExecutorSlot(i) for i in range(num_executors)]
        self.requests: dict[str, _Tracked] = {}
        self.draining = False
        self._work_ids = itertools.count(1)

    @property
    def mode(self) -> str:
        return self.batcher.mode

    def set_mode(self, mode: str) -> None:
        """The batching mode the executors run (known once the first one has loaded)."""
        if mode != self.mode:
            if len(self.batcher):
                raise RuntimeError("cannot change the batching mode while requests wait")
            self.batcher = Batcher(self.max_batch_size, self.max_delay_s, mode)

    @property
    def num_waiting(self) -> int:
        return len(self.batcher)

    @property
    def num_running(self) -> int:
        return len({key[0] for slot in self.slots for key in slot.items})

    @property
    def any_ready(self) -> bool:
        return any(slot.ready for slot in self.slots)

    def is_live(self, request_id: str) -> bool:
        return request_id in self.requests

    # -- requests in -----------------------------------------------------------------------

    def add(self, request: ImageRequest, frames: list[Any], now: float) -> Finished | None:
        """Queue a request; returns a failure answer if it cannot be accepted."""
        if request.request_id in self.requests:
            return self._refuse(request.request_id, 409, f"request id {request.request_id!r} is "
                                "already in use", "invalid_request_error", "duplicate_request_id")
        if len(frames) != request.input_frames:
            return self._refuse(request.request_id, 400, f"a {request.task} request carries "
                                f"{request.input_frames} input frames, not {len(frames)}",
                                "invalid_request_error", "invalid_value")
        if self.max_queue_size and self.num_waiting >= self.max_queue_size:
            return self._refuse(request.request_id, 429, f"The server is overloaded: "
                                f"{self.num_waiting} requests are waiting (--max-queue-size "
                                f"{self.max_queue_size}). Retry later.", "server_error", "overloaded")
        self.requests[request.request_id] = _Tracked(request, list(frames), now)
        self.batcher.add(request, now)
        return None

    def abort(self, request_id: str) -> tuple[bool, list[tuple[int, Cancel]]]:
        """Forget a request whose caller has gone. Returns whether it was known, and a cancel for
        each executor holding some of its images (whatever they send back for it is dropped)."""
        self.batcher.abort(request_id)
        if self.requests.pop(request_id, None) is None:
            return False, []
        return True, [(slot.index, Cancel([request_id])) for slot in self.slots
                      if slot.holds(request_id)]

    def start_drain(self) -> None:
        """The server is stopping: nothing waits for company any more."""
        self.draining = True

    # -- placement -------------------------------------------------------------------------

    def _place(self, signature: tuple) -> ExecutorSlot | None:
        """The least-loaded ready executor that can take a head with ``signature``."""
        candidates = [slot for slot in self.slots if slot.ready and (
            slot.images == 0 or (self.mode == STEP_MODE and slot.signature == signature
                                 and slot.images < self.max_batch_size))]
        return min(candidates, key=lambda s: s.images, default=None)

    def time_until_dispatch(self, now: float) -> float | None:
        """Seconds until :meth:`dispatch` has something to send; None if only an event can change
        that (nothing waiting, or no executor that can take the head)."""
        head = self.batcher.head()
        if head is None:
            return None
        slot = self._place(head[0])
        if slot is None:
            return None
        if slot.images or self.draining:
            return 0.0
        return self.batcher.time_until_ready(now)

    def dispatch(self, now: float) -> list[Dispatch]:
        """Everything that can leave the queue now."""
        sent = []
        while (head := self.batcher.head()) is not None:
            signature, enqueued_at = head
            slot = self._place(signature)
            if slot is None:
                break
            if slot.images:  # a running set with room takes company at its next step
                slices, reason = self.batcher.take(signature, self.max_batch_size - slot.images), JOIN
            else:
                wait = self.batcher.time_until_ready(now)
                if wait > 0 and not self.draining:
                    break
                reason = (FULL if self.batcher.is_full() else DRAIN if wait > 0 else
                          EXECUTOR_FREE if slot.free_since > enqueued_at + self.max_delay_s else DELAY)
                slices = self.batcher.next_batch(now, force=True)
            sent.append(self._assign(slot, slices, reason, now))
        return sent

    def _assign(self, slot: ExecutorSlot, slices: list[Slice], reason: str, now: float) -> Dispatch:
        items, frames, queue_times = [], [], []
        for sl in slices:
            tracked = self.requests[sl.request.request_id]
            if tracked.first_dispatch_at is None:
                tracked.first_dispatch_at = now
                queue_times.append(now - tracked.enqueued_at)
            item = WorkItem(sl.request, sl.start, sl.stop)
            items.append(item)
            frames.extend(tracked.frames)
            slot.items[item.key] = item
            slot.images += item.size
        slot.signature = slices[0].request.signature(self.mode)
        return Dispatch(slot.index, Work(next(self._work_ids), items), frames, reason, queue_times)

    # -- results ---------------------------------------------------------------------------

    def complete(self, executor: int, done: ItemsDone, frames: list[Any], now: float) -> list[Finished]:
        """Take finished items from an executor; returns the requests now fully answered."""
        slot = self.slots[executor]
        expected = sum(r.stop - r.start for r in done.items if r.error is None)
        if len(frames) != expected:
            # Nothing in this message can be trusted to line up: fail what it names.
            return self._release(slot, [(r.request_id, r.start) for r in done.items], now,
                                 500, "the executor returned a malformed result")
        finished: list[Finished] = []
        offset = 0
        for result in done.items:
            count = result.stop - result.start if result.error is None else 0
            item_frames, offset = frames[offset:offset + count], offset + count
            item = slot.items.pop((result.request_id, result.start), None)
            if item is None or item.stop != result.stop:
                continue  # not held here (written off already)
            slot.images -= item.size
            tracked = self.requests.get(result.request_id)
            if tracked is None:
                continue  # aborted meanwhile: its images are dropped
            if result.error is not None:
                finished.extend(self._fail(result.request_id, 500, result.error))
                continue
            tracked.execution_s += result.execution_s
            tracked.prompt_tokens = max(tracked.prompt_tokens, result.prompt_tokens)
            tracked.images.update(zip(range(item.start, item.stop), item_frames))
            if len(tracked.images) == tracked.request.n:
                finished.append(self._done(tracked))
        self._settle(slot, now)
        return finished

    def _done(self, tracked: _Tracked) -> Finished:
        r = tracked.request
        del self.requests[r.request_id]
        return Finished(
            done=RequestDone(r.request_id, r.width, r.height, [r.seed + i for i in range(r.n)],
                             tracked.prompt_tokens),
            frames=[tracked.images[i] for i in range(r.n)], execution_s=tracked.execution_s)

    def _settle(self, slot: ExecutorSlot, now: float) -> None:
        if not slot.items:
            slot.images, slot.signature, slot.free_since = 0, None, now

    # -- executors come and go -------------------------------------------------------------

    def executor_ready(self, executor: int, now: float) -> None:
        slot = self.slots[executor]
        slot.ready, slot.free_since = True, now

    def executor_lost(self, executor: int, message: str, now: float) -> list[Finished]:
        """An executor died: every request it held fails; the queue and the others go on."""
        slot = self.slots[executor]
        slot.ready = False
        return self._release(slot, list(slot.items), now, 500, message)

    def _release(self, slot: ExecutorSlot, keys: list[tuple[str, int]], now: float, status: int,
                 message: str) -> list[Finished]:
        finished = []
        for key in keys:
            item = slot.items.pop(key, None)
            if item is not None:
                slot.images -= item.size
            finished.extend(self._fail(key[0], status, message))
        self._settle(slot, now)
        return finished

    # -- time ------------------------------------------------------------------------------

    def time_until_wakeup(self, now: float) -> float | None:
        """Seconds until the scheduler must act without an event: a dispatch or an expiry."""
        times = [t for t in (self.time_until_dispatch(now), self._time_until_expiry(now))
                 if t is not None]
        return min(times) if times else None

    def expire(self, now: float) -> list[Finished]:
        """Answer 503 to requests that waited longer than the timeout without starting."""
        if not self.request_timeout_s:
            return []
        expired = []
        for request_id in self.batcher.waiting_ids():
            tracked = self.requests[request_id]
            if tracked.first_dispatch_at is not None:
                continue  # started (a split request): it will finish
            if now - tracked.enqueued_at < self.request_timeout_s:
                break  # arrival order: every later one is younger
            expired.append(request_id)
        finished = []
        for request_id in expired:
            finished.extend(self._fail(request_id, 503, (
                f"The request waited {self.request_timeout_s:g} s without starting "
                "(--request-timeout-s) and was dropped; the server is overloaded."), code="timeout"))
        return finished

    def _time_until_expiry(self, now: float) -> float | None:
        if not self.request_timeout_s:
            return None
        for request_id in self.batcher.waiting_ids():
            tracked = self.requests[request_id]
            if tracked.first_dispatch_at is None:
                return max(0.0, tracked.enqueued_at + self.request_timeout_s - now)
        return None

    # -- failures --------------------------------------------------------------------------

    def fail_all(self, status: int, message: str) -> list[Finished]:
        """Answer every request still known (used when the scheduler must stop)."""
        for slot in self.slots:
            slot.items.clear()
            slot.images, slot.signature = 0, None
        finished = []
        for request_id in list(self.requests):
            finished.extend(self._fail(request_id, status, message))
        return finished

    def _fail(self, request_id: str, status: int, message: str,
              code: str | None = None) -> list[Finished]:
        self.batcher.abort(request_id)  # a split request may still have images waiting
        if self.requests.pop(request_id, None) is None:
            return []
        return [Finished(failed=RequestFailed(request_id, status, message, code=code))]

    @staticmethod
    def _refuse(request_id: str, status: int, message: str, type_: str, code: str) -> Finished:
        return Finished(failed=RequestFailed(request_id, status, message, type=type_, code=code))
