"""How work ends: the part of :class:`~diffserve.scheduler.core.SchedulerCore` that takes the
executors' results, answers requests once all their images are made, and fails what a failure
affects (a request's other parts are cancelled; an executor's loss fails only what it held)."""

from __future__ import annotations

import logging

from diffserve.wire.protocol import (
    CANCELLED,
    FINISHED,
    ItemResult,
    ItemsDone,
    RequestDone,
    RequestFailed,
)
from diffserve.scheduler.decisions import Finished
from diffserve.scheduler.slots import ExecutorSlot

log = logging.getLogger(__name__)


class Completion:
    """Results and failures, over the core's requests (``requests``) and executors (``slots``)."""

    # -- results ---------------------------------------------------------------------------

    def complete(self, executor: int, done: ItemsDone, now: float) -> list[Finished]:
        """Take the results of items an executor ended; returns the requests now fully
        answered. A result that does not match what the executor holds is a protocol violation:
        logged, and its request answered 500, so that it is never left without an answer."""
        slot = self.slots[executor]
        finished: list[Finished] = []
        for result in done.items:
            key = (result.request_id, result.start)
            if key in slot.paused and slot.paused[key][0].stop == result.stop:
                # It ended before the pause reached its executor: it needs no resuming.
                item = slot.unpause(key)[0]
                self.batcher.unpause(*key)
            else:
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
                finished.extend(self._fail(result.request_id, 500, message, result.code))
                continue
            tracked.made += item.samples
            tracked.execution_s += result.execution_s
            tracked.prompt_tokens = max(tracked.prompt_tokens, result.prompt_tokens)
            if result.cached_steps is not None:
                tracked.cached_steps = (tracked.cached_steps or {}) | dict(
                    zip(range(result.start, result.stop), result.cached_steps))
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

    def _done(self, tracked) -> Finished:
        r = tracked.request
        del self.requests[r.request_id]
        cached = tracked.cached_steps
        return Finished(done=RequestDone(r.request_id, [r.seed_of(i) for i in range(r.n)],
                                         tracked.prompt_tokens,
                                         None if cached is None else
                                         [cached.get(i, 0) for i in range(r.n)],
                                         self.weight_version),
                        execution_s=tracked.execution_s)

    def _settle(self, slot: ExecutorSlot, now: float) -> None:
        if not slot.items:
            slot.free_since = now

    # -- executors come and go -------------------------------------------------------------

    def executor_ready(self, executor: int, now: float) -> None:
        slot = self.slots[executor]
        slot.ready, slot.free_since = True, now

    def executor_lost(self, executor: int, message: str, now: float) -> list[Finished]:
        """An executor (or a parallel group) died. Each request it held runs again from its
        place in the queue where nothing of it was emitted yet (no image made, no preview or
        progress asked for, no part elsewhere) and it was not retried before; every other one is
        answered 503 with the reason. The queue and the other executors go on."""
        slot = self.slots[executor]
        slot.ready = False
        held = [*slot.items, *slot.paused]
        retried = [rid for rid in dict.fromkeys(key[0] for key in held) if self._retryable(rid, slot)]
        for key in [key for key in held if key[0] in retried]:
            if key in slot.items:
                slot.take(key)
            if key in slot.paused:  # its state went with the executor: it starts over
                slot.unpause(key)
                self.batcher.unpause(*key)
        for rid in retried:
            tracked = self.requests[rid]
            tracked.retries += 1
            self.batcher.add(tracked.request, tracked.enqueued_at)  # at its place in the queue
            log.warning("request %s runs again: %s", rid, message)
        return self._release(slot, [key for key in held if key[0] not in retried], now, 503,
                             message, "executor_restarted")

    def _retryable(self, request_id: str, lost) -> bool:
        tracked = self.requests.get(request_id)
        if tracked is None or tracked.retries or tracked.made:
            return False
        r = tracked.request
        return (not r.partial_images and not r.progress and request_id not in self.batcher
                and not any(slot.holds(request_id) for slot in self.slots if slot is not lost))

    def _release(self, slot: ExecutorSlot, keys: list[tuple[str, int]], now: float, status: int,
                 message: str, code: str | None = None) -> list[Finished]:
        finished = []
        for key in keys:
            if key in slot.items:
                slot.take(key)
            if key in slot.paused:
                slot.unpause(key)
            finished.extend(self._fail(key[0], status, message, code))
        self._settle(slot, now)
        return finished

    # -- failures --------------------------------------------------------------------------

    def fail_started(self, status: int, message: str, code: str) -> list[Finished]:
        """Answer every request that has started and is not done (running, paused, or a part
        still waiting): before new weights, so that no request is made by two versions."""
        started = [rid for rid, t in self.requests.items() if t.first_dispatch_at is not None]
        finished = []
        for slot in self.slots:
            keys = [key for key in [*slot.items, *slot.paused] if key[0] in started]
            for key in keys:
                if key in slot.items:
                    slot.take(key)
                if key in slot.paused:
                    slot.unpause(key)
        for rid in started:
            finished.extend(self._fail(rid, status, message, code))
        return finished

    def fail_all(self, status: int, message: str) -> list[Finished]:
        """Answer every request still known (used when the scheduler must stop)."""
        for slot in self.slots:
            slot.clear()
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
