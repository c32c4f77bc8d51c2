"""What an engine hands back to the executor process: finished work items and previews."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffserve.protocol import WorkItem

if TYPE_CHECKING:  # the scheduler process imports this module and needs no numpy
    import numpy as np

CANCELLED = "cancelled: the client went away"
# How a work item ended, as the step-mode retirement metric counts it.
FINISHED, CANCELLED_OUTCOME, FAILED = "finished", "cancelled", "failed"
OUTCOMES = (FINISHED, CANCELLED_OUTCOME, FAILED)


@dataclass
class Outcome:
    """A work item that is done: its images (uint8, k x H x W x 3) or an error."""

    item: WorkItem
    images: np.ndarray | None
    error: str | None
    execution_s: float
    prompt_tokens: int = 0

    @property
    def status(self) -> str:
        return FINISHED if self.error is None else CANCELLED_OUTCOME if self.error == CANCELLED else FAILED


@dataclass
class Preview:
    """A streamed partial image of one image of a request."""

    request_id: str
    index: int
    partial_index: int
    image: np.ndarray


def describe(error: BaseException) -> str:
    return f"image generation failed: {type(error).__name__}: {error}"


def partial_steps(partial_images: int, steps: int) -> dict[int, int]:
    """After how many of ``steps`` each preview is taken: evenly spaced, never at 0 or at the end
    (the final image is not a preview). Returns steps done -> partial index."""
    at = sorted({round((i + 1) * steps / (partial_images + 1)) for i in range(partial_images)}
                - {0, steps})
    return {done: index for index, done in enumerate(at)}
