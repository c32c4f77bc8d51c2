"""Qwen-Image-Edit and Edit-Plus in the step engine: each edit's prompt is encoded with its own
images and their latents travel beside the generated tokens, staggered requests with and without
true CFG equal the plain pipeline called alone, and neither model generates without an image.

The tiny models keep the real pipelines' geometry, so each input image is VAE-encoded at about
1024x1024 pixels: seconds on a CPU. Edit-Plus's run is marked slow."""

from __future__ import annotations

import numpy as np
import pytest

from diffserve.config.flags import ServerConfig
from diffserve.executor.runtime import build_runtime
from helpers import make_request, run_plan
from diffserve.executor.checks.reference import max_diff, sample_image, solo


def staggered(model: str, images: int) -> None:
    # This test is the start-up check's comparison, staggered: the check itself is skipped.
    rt = build_runtime(ServerConfig(model=model, batching_mode="step", skip_startup_check=True),
                       torch_threads=1)
    assert rt.mode == "step" and rt.info.tasks == ["edit"]
    picture, _ = sample_image(64)
    frames = [picture, np.ascontiguousarray(255 - picture), np.ascontiguousarray(picture[::-1])]
    req = lambda rid, **kw: make_request(request_id=rid, model=model, task="edit",  # noqa: E731
                                         references=images, **kw)
    plan = {0: [(req("cfg", seed=3, steps=3, guidance=4.0, negative_prompt="blurry",
                     prompt="make it red"), frames[:images])],
            1: [(req("plain", seed=4, steps=2, guidance=4.0, prompt="a much longer instruction "
                     "that says to turn the square into a round blue shape"), frames[1:1 + images])]}
    found = run_plan(rt.step_engine(), plan)
    for group in plan.values():
        for r, refs in group:
            assert max_diff(found[r.request_id], solo(rt.loaded, rt.pipelines, r,
                                                      references=refs)) <= 2, r.request_id


def test_qwen_image_edit_edits_staggered_and_exact():
    staggered("tiny-qwen-image-edit", images=1)


@pytest.mark.slow
def test_qwen_image_edit_plus_edits_two_images_staggered_and_exact():
    staggered("tiny-qwen-image-edit-plus", images=2)
