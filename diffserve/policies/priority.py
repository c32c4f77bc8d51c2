"""Priority classes: the waiting request of the best (lowest) priority is the head, ties by
arrival; a request's effective priority improves by one class every ``aging_s`` seconds it waits,
so that nothing starves.

Aging is written into the rank: ``priority x aging_s + enqueued_at``. Time moves every rank
alike, so the order never needs recomputing, and the bound is exact: a request of priority p that
entered at time t goes ahead of every request of priority q that enters after
``t + (p - q) x aging_s``. A batch request (priority 10) waiting behind a stream of interactive
ones (priority 0) is therefore passed only by those that arrive within ``10 x aging_s`` of it.
With ``aging_s`` 0, priority is strict (a request of a worse class waits while better ones keep
coming)."""

from __future__ import annotations

from diffserve.policies.base import QueuedRequest, QueuePolicy


class PriorityOrder(QueuePolicy):
    name = "priority"
    uses_priority = True

    def __init__(self, aging_s: float = 30.0) -> None:
        if aging_s < 0:
            raise ValueError(f"aging_s must be >= 0, got {aging_s}")
        self.aging_s = aging_s

    @classmethod
    def from_config(cls, config) -> "PriorityOrder":
        return cls(config.priority_aging_s)

    def rank(self, request: QueuedRequest, enqueued_at: float) -> tuple:
        if self.aging_s:
            return (request.priority * self.aging_s + enqueued_at,)
        return (request.priority, enqueued_at)
