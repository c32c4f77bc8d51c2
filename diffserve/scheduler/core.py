"""Scheduler logic: the single owner of request state.

No sockets, no torch, no clock: the process wrapper (:mod:`diffserve.scheduler.process`) feeds it
messages and the time, and sends what it returns. That keeps every rule here testable in place.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from diffserve.protocol import (
    Batch,
    BatchResult,
    GenerationRequest,
    RequestDone,
    RequestFailed,
    Sample,
)
from diffserve.scheduler.batcher import Batcher


@dataclass
class _Tracked:
    request: GenerationRequest
    enqueued_at: float
    first_dispatch_at: float | None = None
    images: dict[int, Any] = field(default_factory=dict)  # index -> raw frame
    execution_s: float = 0.0  # pipeline calls that produced its images, summed


@dataclass(frozen=True)
class Dispatch:
    """A batch to send to the executor, with figures for the metrics."""

    batch: Batch
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
    def __init__(self, max_batch_size: int, max_delay_s: float, max_queue_size: int = 0,
                 request_timeout_s: float = 0.0) -> None:
        self.batcher = Batcher(max_batch_size, max_delay_s)
        self.max_queue_size = max_queue_size  # 0: unbounded
        self.request_timeout_s = request_timeout_s  # 0: none
        self.requests: dict[str, _Tracked] = {}
        self.running: Batch | None = None
        self.executor_ready = False
        self._batch_ids = itertools.count(1)

    @property
    def num_waiting(self) -> int:
        return len(self.batcher)

    @property
    def num_running(self) -> int:
        if self.running is None:
            return 0
        return len({s.request_id for s in self.running.samples})

    def add(self, request: GenerationRequest, now: float) -> Finished | None:
        """Queue a request; returns a failure answer if it cannot be accepted."""
        if request.request_id in self.requests:
            return Finished(failed=RequestFailed(
                request.request_id, 409, f"request id {request.request_id!r} is already in use",
                type="invalid_request_error", code="duplicate_request_id"))
        if self.max_queue_size and self.num_waiting >= self.max_queue_size:
            return Finished(failed=RequestFailed(
                request.request_id, 429, f"The server is overloaded: {self.num_waiting} requests are "
                f"waiting (--max-queue-size {self.max_queue_size}). Retry later.",
                type="server_error", code="overloaded"))
        self.requests[request.request_id] = _Tracked(request, now)
        self.batcher.add(request, now)
        return None

    def abort(self, request_id: str) -> bool:
        """Forget a request whose caller has gone. Images of it already in a running batch are
        discarded when they come back."""
        self.batcher.abort(request_id)
        return self.requests.pop(request_id, None) is not None

    def abort_leaves_batch_unwanted(self, request_id: str) -> bool:
        """After aborting ``request_id``: True if nobody is left waiting for the running batch."""
        if self.running is None or request_id not in {s.request_id for s in self.running.samples}:
            return False
        return not any(s.request_id in self.requests for s in self.running.samples)

    def time_until_dispatch(self, now: float) -> float | None:
        """Seconds until :meth:`dispatch` has something to send; None if only an event can change
        that (nothing waiting, or the executor is busy or not ready)."""
        if not self.executor_ready or self.running is not None:
            return None
        return self.batcher.time_until_ready(now)

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

    def dispatch(self, now: float, force: bool = False) -> Dispatch | None:
        """The next batch, if the executor is free and a batch is ready."""
        if not self.executor_ready or self.running is not None:
            return None
        slices = self.batcher.next_batch(now, force=force)
        if not slices:
            return None
        samples, queue_times = [], []
        for sl in slices:
            tracked = self.requests[sl.request.request_id]
            if tracked.first_dispatch_at is None:
                tracked.first_dispatch_at = now
                queue_times.append(now - tracked.enqueued_at)
            r = sl.request
            samples.extend(Sample(r.request_id, i, r.prompt, r.negative_prompt, r.seed + i)
                           for i in range(sl.start, sl.stop))
        self.running = Batch(next(self._batch_ids), slices[0].request.shared_params(), samples)
        return Dispatch(self.running, queue_times)

    def complete(self, result: BatchResult, frames: list[Any]) -> list[Finished]:
        """Take a batch's images; returns the requests that are now fully answered."""
        batch = self.running
        if batch is None or batch.batch_id != result.batch_id:
            return []  # a late result of a batch already written off (executor replaced)
        self.running = None
        if len(frames) != len(result.images):
            return self._fail_batch(batch, 500, "the executor returned a malformed result")
        expected = {(s.request_id, s.index) for s in batch.samples}
        returned = {(m.request_id, m.index) for m in result.images} | {
            (s.request_id, s.index) for s in batch.samples if s.request_id in result.errors}
        if returned != expected:
            return self._fail_batch(batch, 500, "the executor returned images that do not match "
                                    "the batch")
        finished: list[Finished] = []
        for request_id, message in result.errors.items():
            finished.extend(self._fail(request_id, 500, message))
        for request_id in {m.request_id for m in result.images}:
            if request_id in self.requests:
                self.requests[request_id].execution_s += result.execution_time_s
        for meta, frame in zip(result.images, frames):
            tracked = self.requests.get(meta.request_id)
            if tracked is None:
                continue  # aborted or failed meanwhile
            tracked.images[meta.index] = frame
            if len(tracked.images) == tracked.request.n:
                del self.requests[meta.request_id]
                r = tracked.request
                finished.append(Finished(
                    done=RequestDone(r.request_id, result.width, result.height,
                                     [r.seed + i for i in range(r.n)]),
                    frames=[tracked.images[i] for i in range(r.n)],
                    execution_s=tracked.execution_s))
        return finished

    def executor_lost(self, message: str) -> list[Finished]:
        """The executor died: every request it was working on fails; the queue stays."""
        self.executor_ready = False
        batch, self.running = self.running, None
        return self._fail_batch(batch, 500, message) if batch else []

    def fail_all(self, status: int, message: str) -> list[Finished]:
        """Answer every request still known (used when the scheduler must stop)."""
        self.running = None
        finished = []
        for request_id in list(self.requests):
            finished.extend(self._fail(request_id, status, message))
        return finished

    def _fail_batch(self, batch: Batch, status: int, message: str) -> list[Finished]:
        finished = []
        for request_id in dict.fromkeys(s.request_id for s in batch.samples):
            finished.extend(self._fail(request_id, status, message))
        return finished

    def _fail(self, request_id: str, status: int, message: str,
              code: str | None = None) -> list[Finished]:
        self.batcher.abort(request_id)  # a split request may still have images waiting
        if self.requests.pop(request_id, None) is None:
            return []
        return [Finished(failed=RequestFailed(request_id, status, message, code=code))]
