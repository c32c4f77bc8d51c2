"""What an engine hands back to the executor process: finished work items and partial images."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffserve.wire.protocol import CANCELLED, FAILED, FINISHED, ItemResult
from diffserve.wire.request import WorkItem

if TYPE_CHECKING:
    import numpy as np

CANCELLED_MESSAGE = "cancelled: the client went away"
NON_FINITE = "non_finite_output"  # the error code of an image with NaN or infinite pixels


@dataclass
class Outcome:
    """A work item that ended: ``made`` (its images, uint8 k x H x W x 3), ``failed`` or
    ``cancelled``."""

    item: WorkItem
    status: str
    images: np.ndarray | None
    error: str | None
    execution_s: float
    prompt_tokens: int = 0
    tensors: dict | None = None  # rollouts: the answer's tensors (diffserve.wire.rollouts)
    cached_steps: list[int] | None = None  # per image, steps that reused its step cache
    code: str | None = None  # a failure's error code for the client (e.g. non_finite_output)
    # Videos with sound: each video's track (k, channels, samples, float32) at ``sample_rate``.
    audio: np.ndarray | None = None
    sample_rate: int = 0

    @classmethod
    def made(cls, item: WorkItem, images, execution_s: float, prompt_tokens: int = 0,
             tensors: dict | None = None, cached_steps: list[int] | None = None,
             audio=None, sample_rate: int = 0) -> "Outcome":
        return cls(item, FINISHED, images, None, execution_s, prompt_tokens, tensors,
                   cached_steps, audio=audio, sample_rate=sample_rate)

    @classmethod
    def failed(cls, item: WorkItem, error: str | BaseException, execution_s: float) -> "Outcome":
        """``error``: the message, or the exception (its code, if it has one, goes along)."""
        if isinstance(error, BaseException):
            return cls(item, FAILED, None, describe(error), execution_s,
                       code=getattr(error, "code", None))
        return cls(item, FAILED, None, error, execution_s)

    @classmethod
    def cancelled(cls, item: WorkItem, execution_s: float) -> "Outcome":
        return cls(item, CANCELLED, None, CANCELLED_MESSAGE, execution_s)

    def result(self) -> ItemResult:
        item = self.item
        return ItemResult(item.request.request_id, item.start, item.stop, self.status,
                          self.execution_s, self.error, self.prompt_tokens,
                          list(self.cached_steps) if self.cached_steps is not None else None,
                          self.code)


@dataclass
class PartialImage:
    """A streamed partial image of one image of a request."""

    request_id: str
    index: int
    partial_index: int
    image: np.ndarray


FAILURE = "image generation failed: "  # how a request's error answer begins


def describe(error: BaseException) -> str:
    return f"{FAILURE}{type(error).__name__}: {error}"


def partial_steps(partial_images: int, steps: int) -> dict[int, int]:
    """After how many of ``steps`` each preview is taken: evenly spaced, never at 0 or at the end
    (the final image is not a preview). Returns steps done -> partial index."""
    at = sorted({round((i + 1) * steps / (partial_images + 1)) for i in range(partial_images)}
                - {0, steps})
    return {done: index for index, done in enumerate(at)}
