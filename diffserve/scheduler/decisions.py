"""What the scheduler core hands its process to send: work for an executor, with why it left the
queue, and final answers for the frontend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diffserve.wire.protocol import RequestDone, RequestFailed
from diffserve.wire.request import Work


@dataclass(frozen=True)
class Dispatch:
    """Work to send to one executor, with figures for the metrics."""

    executor: int
    work: Work
    frames: list[Any]
    reason: str  # one of DISPATCH_REASONS (diffserve.wire.protocol)
    queue_times_s: list[float]  # one per request dispatched for the first time
    priorities: list[int] = field(default_factory=list)  # and its priority class


@dataclass(frozen=True)
class Finished:
    """A final answer for the frontend: ``done`` or ``failed``."""

    done: RequestDone | None = None
    failed: RequestFailed | None = None
    execution_s: float | None = None  # with ``done``: time of the calls that made its images

    @property
    def request_id(self) -> str:
        return (self.done or self.failed).request_id
