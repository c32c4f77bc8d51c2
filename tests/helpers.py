"""Small builders shared by the tests."""

from __future__ import annotations

import itertools

from diffserve.protocol import GENERATE, ImageRequest

_ids = itertools.count()


def make_request(n: int = 1, *, request_id: str | None = None, width: int = 64, height: int = 64,
                 steps: int = 4, guidance: float = 5.0, prompt: str | None = None, seed: int = 0,
                 model: str = "tiny-sd", negative_prompt: str = "", task: str = GENERATE,
                 strength: float = 1.0, partial_images: int = 0) -> ImageRequest:
    rid = request_id or f"r{next(_ids)}"
    return ImageRequest(request_id=rid, model=model, width=width, height=height, task=task,
                        num_inference_steps=steps, guidance_scale=guidance, strength=strength,
                        prompt=prompt or f"prompt of {rid}", negative_prompt=negative_prompt,
                        seed=seed, n=n, partial_images=partial_images)


def exit_with(code: int) -> None:
    """A process entry that exits at once with ``code`` (a stand-in executor that crashes)."""
    import os

    os._exit(code)
