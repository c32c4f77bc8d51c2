"""What a policy sees and decides. Pure objects: no sockets, no torch, no clock of their own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Hashable, Mapping, Protocol, Sequence


class QueuedRequest(Protocol):
    """What the queue order may read of a waiting request (an ``ImageRequest``)."""

    n: int
    num_inference_steps: int
    cost: float
    priority: int


class QueuePolicy:
    """Orders the waiting queue. The head (the request of the lowest rank) is always in the next
    batch or admission; requests that share its batch key join it in rank order.

    A rank is fixed when a request enters, so the queue stays sorted without ranking it again; a
    rule that changes with time must be written so that time moves every rank alike (an aging
    priority, say, counts each priority level as so many seconds of arrival time)."""

    name: ClassVar[str]
    uses_priority: ClassVar[bool] = False  # whether a request's priority field means anything

    @classmethod
    def from_config(cls, config) -> "QueuePolicy":
        """The policy with its options from the server's configuration."""
        return cls()

    def rank(self, request: QueuedRequest, enqueued_at: float) -> tuple:
        raise NotImplementedError


@dataclass
class Member:
    """A running request as the set choice sees it: its time since it arrived (in the queue and
    running), the steps it took part in, and the steps it has left."""

    arrived_at: float
    total_steps: int = 0
    stepped_s: float = 0.0  # time of the steps it took part in
    steps: int = 0

    def lost(self, now: float) -> float:
        """Time it spent not being stepped: its age minus the time of its own steps."""
        return now - self.arrived_at - self.stepped_s

    @property
    def remaining(self) -> int:
        return max(0, self.total_steps - self.steps)

    def stepped(self, seconds: float) -> None:
        self.stepped_s += seconds
        self.steps += 1

    def charge(self, seconds: float) -> None:
        """A step's seconds read after the step (its count was taken by :meth:`stepped`)."""
        self.stepped_s += seconds


class SetPolicy:
    """Picks which running set the next denoising step advances (``sets``: every non-empty set's
    members, keyed by the set's batch key)."""

    name: ClassVar[str]

    def choose(self, sets: Mapping[Hashable, Sequence[Member]], now: float) -> Hashable:
        raise NotImplementedError
