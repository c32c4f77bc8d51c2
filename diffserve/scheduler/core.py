"""Scheduler logic: the single owner of request state.

No sockets, no torch, no clock: the process wrapper (:mod:`diffserve.scheduler.service`) feeds
it messages and the time, and sends what it returns. That keeps every rule here testable in place.

One queue feeds every executor; a queue policy orders it (:mod:`diffserve.policies`). Each
executor has a slot: the items it holds (sent and not yet answered), grouped by batch key into
the running sets they form. The core is three parts: requests in and time (here), placement and
dispatch (:mod:`diffserve.scheduler.placement`), results and failures
(:mod:`diffserve.scheduler.completion`).

A request with more images than fit is split into parts, which may run on several executors;
its answer waits for every part, and when one part fails, the others are cancelled.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any

from diffserve.policies import QueuePolicy
from diffserve.wire.weight_commands import BASE_VERSION
from diffserve.wire.protocol import (  # noqa: F401  (the reasons are the core's vocabulary)
    DELAY,
    DISPATCH_REASONS,
    DRAIN,
    EXECUTOR_FREE,
    FULL,
    JOIN,
    NEW_SET,
    REQUEST_MODE,
    Cancel,
)
from diffserve.wire.request import ImageRequest
from diffserve.scheduler.batcher import Batcher
from diffserve.scheduler.completion import Completion
from diffserve.scheduler.decisions import Finished
from diffserve.scheduler.placement import Placement
from diffserve.scheduler.slots import ExecutorSlot, Pricing

log = logging.getLogger(__name__)


@dataclass
class _Tracked:
    request: ImageRequest
    frames: list[Any]  # its input frames (checked against its manifest when it was decoded),
    # forwarded with every item of the request
    enqueued_at: float
    first_dispatch_at: float | None = None
    made: int = 0  # images finished (their pixels went to the frontend)
    execution_s: float = 0.0  # pipeline time of the items that made its images, summed
    prompt_tokens: int = 0
    cached_steps: dict[int, int] | None = None  # image -> its steps that reused a step cache
    retries: int = 0  # runs again after its executor died (at most once)


class SchedulerCore(Placement, Completion):
    def __init__(self, max_batch_size: int, max_delay_s: float, num_executors: int = 1,
                 max_queue_size: int = 0, request_timeout_s: float = 0.0,
                 mode: str = REQUEST_MODE, max_batch_cost: float = math.inf,
                 max_running_cost: float = math.inf, policy: QueuePolicy | None = None,
                 max_loras: int = 0) -> None:
        """``max_loras``: adapter slots per executor (0: adapters are not counted)."""
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.max_queue_size = max_queue_size  # 0: unbounded
        self.request_timeout_s = request_timeout_s  # 0: none
        self.max_batch_cost = max_batch_cost
        self.max_running_cost = max_running_cost
        self.max_loras = max_loras
        self.policy = policy
        self.policy_uses_priority = bool(policy and policy.uses_priority)
        self.preemptions = 0  # items paused to make room for better classes (step mode)
        self._pauses: list[tuple[int, list[tuple[str, int]]]] = []
        self.waits_for_room = 0  # heads that had to wait for running-cost room (step mode)
        self._waiting_head: str | None = None
        self.batcher = Batcher(max_batch_size, max_delay_s, mode, max_batch_cost, policy)
        self.slots = [ExecutorSlot(i) for i in range(num_executors)]
        self.requests: dict[str, _Tracked] = {}
        self.draining = False
        # The control plane (diffserve.scheduler.weight_updates): while held, nothing leaves the queue
        # (a weight update or a sleep is under way); refusing: new requests get 503 (asleep).
        self.held = False
        self.refusing: str | None = None
        self.weight_version = BASE_VERSION  # stamped on every answer
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
                 max_running_cost: float | None = None,
                 task_modes: dict[str, str] | None = None,
                 mixed_sizes: frozenset[str] = frozenset(), pricing: Pricing | None = None) -> None:
        """The batching mode the executors run, each task's where it differs, the tasks whose
        sizes share a forward (``pricing``: how their padding is priced), and the model's cost
        bounds (known once the first one has loaded)."""
        self.max_batch_cost = max_batch_cost or self.max_batch_cost
        self.max_running_cost = max_running_cost or self.max_running_cost
        task_modes = {task: m for task, m in (task_modes or {}).items() if m != mode}
        mixed_sizes = frozenset(mixed_sizes)
        for slot in self.slots:
            slot.pricing = pricing or Pricing()
        if len(self.batcher) and (mode, task_modes, mixed_sizes) != (
                self.mode, self.batcher.task_modes, self.batcher.mixed_sizes):
            raise RuntimeError("cannot change the batching mode while requests wait")
        if not len(self.batcher):
            self.batcher = Batcher(self.max_batch_size, self.max_delay_s, mode,
                                   self.max_batch_cost, self.policy, task_modes, mixed_sizes)

    @property
    def num_waiting(self) -> int:
        return len(self.batcher)

    @property
    def num_running(self) -> int:
        return len({key[0] for slot in self.slots for key in slot.items})

    @property
    def num_paused(self) -> int:
        return sum(len(slot.paused) for slot in self.slots)

    @property
    def busy(self) -> bool:
        """Whether any executor holds work (sent and not answered)."""
        return any(slot.items for slot in self.slots)

    @property
    def any_ready(self) -> bool:
        return any(slot.ready for slot in self.slots)

    def is_live(self, request_id: str) -> bool:
        return request_id in self.requests

    # -- requests in -----------------------------------------------------------------------

    def add(self, request: ImageRequest, frames: list[Any], now: float) -> Finished | None:
        """Queue a request; returns a failure answer if it cannot be accepted. ``frames`` are
        the ones its manifest declares (:func:`diffserve.wire.protocol.decode` checked them)."""
        if request.request_id in self.requests:
            return self._refuse(request.request_id, 409, f"request id {request.request_id!r} is "
                                "already in use", "invalid_request_error", "duplicate_request_id")
        if self.refusing:
            return self._refuse(request.request_id, 503, self.refusing, "server_error", "sleeping")
        if self.max_queue_size and self.num_waiting >= self.max_queue_size:
            return self._refuse(request.request_id, 429, f"The server is overloaded: "
                                f"{self.num_waiting} requests are waiting (--max-queue-size "
                                f"{self.max_queue_size}). Retry later.", "server_error", "overloaded")
        self.requests[request.request_id] = _Tracked(request, list(frames), now)
        self.batcher.add(request, now)
        return None

    def refuse_malformed(self, request: ImageRequest, reason: str) -> Finished | None:
        """The answer to a request whose frames were not those it declared (a 400), unless its
        id belongs to a request already queued (which is not touched)."""
        if request.request_id in self.requests:
            return None
        return self._refuse(request.request_id, 400, reason, "invalid_request_error",
                            "invalid_value")

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
        for slot in self.slots:  # its paused parts: the cancel drops their state there
            for key in [key for key in slot.paused if key[0] == request_id]:
                slot.unpause(key)
        return True

    def start_drain(self) -> None:
        """The server is stopping: nothing waits for company any more."""
        self.draining = True

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
