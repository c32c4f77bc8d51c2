"""First come, first served: the oldest waiting request is the head."""

from __future__ import annotations

from diffserve.policies.base import QueuedRequest, QueuePolicy


class FirstCome(QueuePolicy):
    name = "fcfs"

    def rank(self, request: QueuedRequest, enqueued_at: float) -> tuple:
        return (enqueued_at,)
