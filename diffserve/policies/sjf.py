"""Shortest job first: the waiting request with the least work is the head (work: images x
steps x what an image costs a forward), ties by arrival. It lowers the mean wait when short and
long requests mix; a long request waits while shorter ones keep coming, so it suits batch work
whose callers care about throughput, not about any one request's latency. A request split over
several admissions keeps its place (its key is its whole work, fixed when it arrived)."""

from __future__ import annotations

from diffserve.policies.base import QueuedRequest, QueuePolicy


class ShortestJobFirst(QueuePolicy):
    name = "sjf"

    def rank(self, request: QueuedRequest, enqueued_at: float) -> tuple:
        return (request.n * request.num_inference_steps * request.cost, enqueued_at)
