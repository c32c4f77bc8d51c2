"""HunyuanVideo 1.5 image-to-video in the step engine: every video equals the plain diffusers
image-to-video pipeline called alone (frames within 2/255), with requests of different steps,
guidance, seeds, images and sizes joining at different steps; rows of one size share
forwards. The pipeline is called at the request's size (docs/videos.md)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import make_request, rows_per_forward, run_plan

from diffserve.executor.checks.reference import max_diff, solo
from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.step.engine import StepEngine

MODEL = "tiny-hunyuan-video15-i2v"
TOLERANCE = 2


@pytest.fixture(scope="module")
def model():
    loaded = load_model(MODEL, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe, family_for(loaded.pipeline_class))
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    return loaded, pipelines, family


def video(seed: int, frames: int = 5, width: int = 32, height: int = 32, **fields):
    image = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    request = make_request(model=MODEL, task="image-to-video", width=width, height=height,
                           seed=seed, **fields)
    return dataclasses.replace(request, num_frames=frames), image


def test_videos_equal_the_pipeline_alone(model):
    loaded, pipelines, family = model
    assert "image-to-video" in pipelines and "generate" not in pipelines
    a, ia = video(1, steps=3, guidance=6.0)
    b, ib = video(2, steps=2, guidance=3.0, negative_prompt="blurry")
    c, ic = video(3, steps=2, guidance=1.0)  # no guidance: one row
    d, idd = video(4, frames=3, steps=2, width=48, height=32)  # another size: a set of its own
    plan = {0: [(a, [ia])], 1: [(b, [ib]), (d, [idd])], 2: [(c, [ic])]}
    with rows_per_forward(family) as shared:
        images = run_plan(StepEngine(family), plan)
    assert max(shared) >= 4  # a's and b's guided rows shared forwards
    for request, image in ((a, ia), (b, ib), (c, ic), (d, idd)):
        expected = solo(loaded, pipelines, request, image=image)
        got = images[request.request_id]
        assert got.shape == expected.shape == (1, request.num_frames, request.height,
                                               request.width, 3)
        assert max_diff(got, expected) <= TOLERANCE, request.request_id


def test_request_mode_serves_the_requested_size(model):
    """Request mode calls the pipeline itself: its size pick is the request's there too (48x32,
    where the pipeline's own rule, by its 32x32 target, would make 32x24)."""
    from diffserve.executor.request.runner import RequestRunner
    from diffserve.wire.request import Work, WorkItem

    loaded, pipelines, family = model
    request, image = video(5, frames=3, steps=2, width=48, height=32)
    (outcome,) = RequestRunner(loaded, pipelines, family).execute(
        Work(1, [WorkItem(request, 0, 1)]), [[image]])
    assert outcome.error is None, outcome.error
    assert outcome.images.shape == (1, 3, 32, 48, 3)
    assert max_diff(outcome.images, solo(loaded, pipelines, request, image=image)) <= TOLERANCE
