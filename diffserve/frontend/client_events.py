"""What the frontend's end of the engine link (:mod:`diffserve.frontend.scheduler_client`)
hands its callers: a request's events (a partial image, its progress, its final answer) and
what it keeps of a request in flight."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from diffserve.wire.protocol import Partial, RequestDone


class StartupError(RuntimeError):
    pass


@dataclass
class PartialEvent:
    """A partial image of one of the request's images."""

    partial: Partial
    frame: Any


@dataclass
class ProgressEvent:
    """The request's denoising steps done of its total (requests that asked for progress)."""

    done: int
    total: int


@dataclass
class DoneEvent:
    done: RequestDone
    frames: list[Any]  # the request's images, in index order
    tensors: dict[str, Any] | None = None  # rollouts: the answer's tensors (diffserve.wire.rollouts)
    # Videos with sound: each one's track as it came, (float32 samples channel after channel,
    # channels, sample rate), or None.
    sounds: list[tuple | None] = field(default_factory=list)


@dataclass
class _Pending:
    """A request in flight: its event queue and the images that came for it so far."""

    n: int
    wants_tensors: bool = False  # a rollout: its parts come as tensors, not images
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    images: dict[int, Any] = field(default_factory=dict)
    tensors: dict[int, tuple[int, dict[str, Any]]] = field(default_factory=dict)  # start -> part
    sounds: dict[int, tuple] = field(default_factory=dict)  # videos with sound: index -> track
    done: RequestDone | None = None
    grace: asyncio.TimerHandle | None = None

    def complete(self) -> bool:
        if self.done is None:
            return False
        if self.wants_tensors:
            return sum(stop - start for start, (stop, _) in self.tensors.items()) == self.n
        return len(self.images) == self.n


async def final_event(submission) -> "DoneEvent":
    """A submission's one final answer (its partial images and progress passed over); the
    submission closed after, whatever happens."""
    try:
        while True:
            event = await submission.next()
            if isinstance(event, DoneEvent):
                return event
    finally:
        submission.close()
