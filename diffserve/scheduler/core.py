"""Scheduler logic: the single owner of request state.

No sockets, no torch, no clock: the process wrapper (:mod:`diffserve.scheduler.process`) feeds
it messages and the time, and sends what it returns. That keeps every rule here testable in place.

One queue feeds every executor. Each executor has a slot: the items it holds (sent and not yet
answered), grouped by signature into the running sets they form. Admission counts images
(``max_batch_size`` per forward) and cost (``request.cost`` per image, see
:mod:`diffserve.costs`: ``max_batch_cost`` per forward, ``max_running_cost`` per executor across
its sets). Placement:

- **request mode**: a batch goes to an idle executor once the batcher says it is ready (full, or
  its oldest request waited the delay, or the server is draining).
- **step mode**: an executor whose running set has the head's signature and room takes the head
  and its compatible followers at once ("join"); a busy executor with running-cost room starts a
  new set for another signature at once ("new_set": it runs from the executor's next step); an
  idle executor starts a set by the same rules as a batch. When the head fits no executor,
  nothing of its signature passes it, so the head never starves; requests of other signatures
  may join or open their own sets on busy executors meanwhile, but only within what each
  executor's running budget keeps free beyond the head's next image, so they never delay it.
- Among the executors that can take the head, the least loaded (by cost) gets it, one that
  batches it into a running set of its signature before one that would open a new set.

A request with more images than fit is split into parts, which may run on several executors;
its answer waits for every part, and when one part fails, the others are cancelled.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any

from diffserve.protocol import (
    CANCELLED,
    FINISHED,
    REQUEST_MODE,
    STEP_MODE,
    Cancel,
    ImageRequest,
    ItemResult,
    ItemsDone,
    RequestDone,
    RequestFailed,
    Work,
    WorkItem,
)
from diffserve.scheduler.batcher import Batcher, Slice
from diffserve.scheduler.decisions import (  # noqa: F401  (the reasons are the core's vocabulary)
    DELAY,
    DISPATCH_REASONS,
    DRAIN,
    EXECUTOR_FREE,
    FULL,
    JOIN,
    NEW_SET,
    Dispatch,
    Finished,
)
from diffserve.scheduler.slots import ExecutorSlot, RunningSet

log = logging.getLogger(__name__)

@dataclass
class _Tracked:
    request: ImageRequest
    frames: list[Any]  # input pixels (edits), forwarded with every item of the request
    enqueued_at: float
    first_dispatch_at: float | None = None
    made: int = 0  # images finished (their pixels went to the frontend)
    execution_s: float = 0.0  # pipeline time of the items that made its images, summed
    prompt_tokens: int = 0


@dataclass(frozen=True)
class _Placement:
    slot: ExecutorSlot
    room: int         # images the head's group may bring
    room_cost: float  # and their cost
    joins: bool       # into a running set of the head's signature


class SchedulerCore:
    def __init__(self, max_batch_size: int, max_delay_s: float, num_executors: int = 1,
                 max_queue_size: int = 0, request_timeout_s: float = 0.0,
                 mode: str = REQUEST_MODE, max_batch_cost: float = math.inf,
                 max_running_cost: float = math.inf) -> None:
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.max_queue_size = max_queue_size  # 0: unbounded
        self.request_timeout_s = request_timeout_s  # 0: none
        self.max_batch_cost = max_batch_cost
        self.max_running_cost = max_running_cost
        self.waits_for_room = 0  # heads that had to wait for running-cost room (step mode)
        self._waiting_head: str | None = None
        self.batcher = Batcher(max_batch_size, max_delay_s, mode, max_batch_cost)
        self.slots = [ExecutorSlot(i) for i in range(num_executors)]
        self.requests: dict[str, _Tracked] = {}
        self.draining = False
        self._work_ids = itertools.count(1)
        self._cancels: list[tuple[int, Cancel]] = []

    def take_cancels(self) -> list[tuple[int, Cancel]]:
        """Cancels decided since the last call, each for the executor that holds the work: the
        parts of requests that were aborted or failed elsewhere."""
        cancels, self._cancels = self._cancels, []
        return cancels
    @property
    def mode(self) -> str:
        return self.batcher.mode

    def set_mode(self, mode: str, max_batch_cost: float | None = None,
                 max_running_cost: float | None = None) -> None:
        """The batching mode the executors run and the model's cost bounds (known once the
        first one has loaded)."""
        self.max_batch_cost = max_batch_cost or self.max_batch_cost
        self.max_running_cost = max_running_cost or self.max_running_cost
        if len(self.batcher) and mode != self.mode:
            raise RuntimeError("cannot change the batching mode while requests wait")
        if not len(self.batcher):
            self.batcher = Batcher(self.max_batch_size, self.max_delay_s, mode, self.max_batch_cost)

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

    def abort(self, request_id: str) -> bool:
        """Forget a request whose caller has gone; whether it was known. Each executor holding
        some of its images gets a cancel (:meth:`take_cancels`); what they send back for it is
        dropped."""
        return self._forget(request_id)

    def _forget(self, request_id: str) -> bool:
        self.batcher.abort(request_id)
        if self.requests.pop(request_id, None) is None:
            return False
        self._cancels.extend((slot.index, Cancel([request_id])) for slot in self.slots
                             if slot.holds(request_id))
        return True

    def start_drain(self) -> None:
        """The server is stopping: nothing waits for company any more."""
        self.draining = True

    # -- placement -------------------------------------------------------------------------

    def _room(self, slot: ExecutorSlot, signature: tuple, reserve: float = 0.0) -> _Placement | None:
        """What ``slot`` could take of the oldest waiting request of ``signature``, if anything,
        keeping ``reserve`` of its running budget free."""
        if not slot.ready:
            return None
        if not slot.sets:  # idle: a new batch or set, by the batching rules
            return _Placement(slot, self.max_batch_size, min(self.max_batch_cost, self.max_running_cost), False)
        if self.mode != STEP_MODE:
            return None  # request mode: one call in flight per executor
        running = slot.sets.get(signature, RunningSet())
        room = self.max_batch_size - running.samples
        room_cost = min(self.max_batch_cost - running.cost,
                        self.max_running_cost - slot.cost - reserve)
        if not self.batcher.fits(signature, room, room_cost):
            return None
        return _Placement(slot, room, room_cost, signature in slot.sets)

    def _place(self, signature: tuple, reserve: float = 0.0,
               busy_only: bool = False) -> _Placement | None:
        """Where the oldest request of ``signature`` goes: the least loaded executor that can
        take it, one that batches it into a running set of its signature before one that opens
        a new set."""
        options = [p for slot in self.slots if (slot.sets or not busy_only)
                   and (p := self._room(slot, signature, reserve)) is not None]
        return min(options, key=lambda p: (p.slot.cost, not p.joins), default=None)

    def time_until_dispatch(self, now: float) -> float | None:
        """Seconds until :meth:`dispatch` has something to send; None if only an event can change
        that (nothing waiting, or no executor that can take the head)."""
        head = self.batcher.head()
        if head is None:
            return None
        placed = self._place(head[0])
        if placed is None:
            return None
        if placed.slot.sets or self.draining:
            return 0.0
        return self.batcher.time_until_ready(now, placed.room, placed.room_cost)

    def dispatch(self, now: float) -> list[Dispatch]:
        """Everything that can leave the queue now."""
        sent = []
        while (head := self.batcher.head()) is not None:
            signature, enqueued_at = head
            placed = self._place(signature)
            if placed is None:
                self._head_waits()
                if self.mode == STEP_MODE:
                    sent += self._beside_head(signature, now)
                break
            slot = placed.slot
            if slot.sets:  # a busy executor takes it at its next step, into a set of its own size
                slices = self.batcher.take(signature, placed.room, placed.room_cost)
                reason = JOIN if placed.joins else NEW_SET
            else:
                wait = self.batcher.time_until_ready(now, placed.room, placed.room_cost)
                if wait > 0 and not self.draining:
                    break
                reason = (FULL if self.batcher.is_full(placed.room, placed.room_cost) else
                          DRAIN if wait > 0 else EXECUTOR_FREE
                          if slot.free_since > enqueued_at + self.max_delay_s else DELAY)
                slices = self.batcher.next_batch(now, True, placed.room, placed.room_cost)
            sent.append(self._assign(slot, slices, reason, now))
        return sent

    def _beside_head(self, head: tuple, now: float) -> list[Dispatch]:
        """Step mode, while the head waits for room in its own running set: the oldest requests
        of other signatures join (or open) their sets on busy executors, as long as each keeps
        room in its running budget for the head's next image. Nothing they take is room the
        head's set could use, so the head is admitted exactly when it would have been had
        nothing passed it, and the other sets do not drain meanwhile."""
        reserve = self.batcher.head_image_cost()
        sent = []
        for signature in self.batcher.signatures():
            if signature == head:
                continue
            while (placed := self._place(signature, reserve, busy_only=True)) is not None:
                slices = self.batcher.take_group(signature, placed.room, placed.room_cost)
                if not slices:
                    break
                sent.append(self._assign(placed.slot, slices, JOIN if placed.joins else NEW_SET,
                                         now))
        return sent

    def _head_waits(self) -> None:
        """Count a head that no executor has room for while some could serve it (once each)."""
        head = next(self.batcher.waiting_ids(), None)
        if (self.mode == STEP_MODE and head != self._waiting_head and self.any_ready
                and all(slot.sets for slot in self.slots if slot.ready)):
            self._waiting_head = head
            self.waits_for_room += 1

    def _assign(self, slot: ExecutorSlot, slices: list[Slice], reason: str, now: float) -> Dispatch:
        items, frames, queue_times = [], [], []
        for sl in slices:
            tracked = self.requests[sl.request.request_id]
            if tracked.first_dispatch_at is None:
                tracked.first_dispatch_at = now
                queue_times.append(now - tracked.enqueued_at)
            item = WorkItem(sl.request, sl.start, sl.stop, now - tracked.enqueued_at)
            items.append(item)
            frames.extend(tracked.frames)
            slot.put(item, sl.request.signature(self.mode))
        return Dispatch(slot.index, Work(next(self._work_ids), items), frames, reason, queue_times)

    # -- results ---------------------------------------------------------------------------

    def complete(self, executor: int, done: ItemsDone, now: float) -> list[Finished]:
        """Take the results of items an executor ended; returns the requests now fully
        answered. A result that does not match what the executor holds is a protocol violation:
        logged, and its request answered 500, so that it is never left without an answer."""
        slot = self.slots[executor]
        finished: list[Finished] = []
        for result in done.items:
            key = (result.request_id, result.start)
            item = slot.get(key)
            if item is None or item.stop != result.stop:
                finished.extend(self._violation(slot, key, result, executor))
                continue
            slot.take(key)
            tracked = self.requests.get(result.request_id)
            if tracked is None:
                continue  # aborted or failed meanwhile: its images are dropped
            if result.status != FINISHED:
                # A part cancelled without its request being aborted can only mean the executor
                # gave up on it (e.g. shutting down): the request fails either way.
                message = result.error or ("cancelled" if result.status == CANCELLED else "failed")
                finished.extend(self._fail(result.request_id, 500, message))
                continue
            tracked.made += item.samples
            tracked.execution_s += result.execution_s
            tracked.prompt_tokens = max(tracked.prompt_tokens, result.prompt_tokens)
            if tracked.made == tracked.request.n:
                finished.append(self._done(tracked))
        self._settle(slot, now)
        return finished

    def _violation(self, slot: ExecutorSlot, key: tuple[str, int], result: ItemResult,
                   executor: int) -> list[Finished]:
        log.error("executor %d answered images %d..%d of %s, which it does not hold as such; "
                  "failing the request", executor, result.start, result.stop, result.request_id)
        if key in slot.items:
            slot.take(key)
        return self._fail(result.request_id, 500, "the executor returned a result that does not "
                          "match its work (an internal error)")

    def _done(self, tracked: _Tracked) -> Finished:
        r = tracked.request
        del self.requests[r.request_id]
        return Finished(done=RequestDone(r.request_id, [r.seed_of(i) for i in range(r.n)],
                                         tracked.prompt_tokens), execution_s=tracked.execution_s)

    def _settle(self, slot: ExecutorSlot, now: float) -> None:
        if not slot.items:
            slot.free_since = now

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
            if key in slot.items:
                slot.take(key)
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
            slot.sets.clear()
        finished = []
        for request_id in list(self.requests):
            finished.extend(self._fail(request_id, status, message))
        return finished

    def _fail(self, request_id: str, status: int, message: str,
              code: str | None = None) -> list[Finished]:
        """Answer a request with an error; its other parts, waiting or running, are dropped."""
        if not self._forget(request_id):
            return []
        return [Finished(failed=RequestFailed(request_id, status, message, code=code))]

    @staticmethod
    def _refuse(request_id: str, status: int, message: str, type_: str, code: str) -> Finished:
        return Finished(failed=RequestFailed(request_id, status, message, type=type_, code=code))
