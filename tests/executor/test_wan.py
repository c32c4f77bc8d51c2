"""Wan in the step engine: every video equals the plain diffusers pipeline called alone (frames
within 2/255 before any encoding), with requests joining at different steps, with different
steps, guidance and negative prompts; Wan 2.2's two experts with requests at different noise
levels in one running set; image-to-video; and request mode's answer for video pipelines."""

from __future__ import annotations

import pytest

from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.request.runner import RequestRunner
from diffserve.executor.step.engine import StepEngine
from diffserve.wire.request import Work, WorkItem
from helpers import make_request, rows_per_forward, run_plan
from diffserve.executor.checks.reference import max_diff, sample_image, solo

TOLERANCE = 2


def setup(name: str):
    loaded = load_model(name, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe, family_for(loaded.pipeline_class))
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    return loaded, pipelines, family


def video(model: str, frames: int = 9, **fields):
    import dataclasses

    fields.setdefault("width", 32)
    fields.setdefault("height", 32)
    extra = {k: fields.pop(k) for k in ("num_frames", "guidance_scale_2") if k in fields}
    request = make_request(model=model, **fields)
    return dataclasses.replace(request, num_frames=frames, **extra)


def check(loaded, pipelines, images, plan, inputs=None):
    for requests in plan.values():
        for request, frames in requests:
            expected = solo(loaded, pipelines, request, image=frames[0] if frames else None)
            got = images[request.request_id]
            assert got.shape == expected.shape == (1, request.num_frames, request.height,
                                                   request.width, 3)
            assert max_diff(got, expected) <= TOLERANCE, request.request_id


def test_wan21_videos_joining_mid_run_equal_the_pipeline_alone():
    loaded, pipelines, family = setup("tiny-wan")
    a = video("tiny-wan", steps=6, guidance=5.0, seed=1)
    b = video("tiny-wan", steps=4, guidance=3.0, seed=2, negative_prompt="blurry")
    c = video("tiny-wan", steps=5, guidance=1.0, seed=3)  # no guidance: one row
    d = video("tiny-wan", frames=5, steps=4, seed=4, width=48)  # another running set
    plan = {0: [(a, [])], 2: [(b, []), (d, [])], 3: [(c, [])]}
    with rows_per_forward(family) as shared:
        images = run_plan(StepEngine(family), plan)
    check(loaded, pipelines, images, plan)
    assert max(shared) >= 4  # a's and b's guided rows shared forwards


def test_wan22_experts_switch_per_request_within_one_forward():
    loaded, pipelines, family = setup("tiny-wan22")
    assert family.boundary == pytest.approx(875.0)
    a = video("tiny-wan22", steps=8, seed=5, guidance=4.0, guidance_scale_2=2.0)
    b = video("tiny-wan22", steps=8, seed=6, guidance=3.0)
    plan = {0: [(a, [])], 3: [(b, [])]}
    mixed = []
    real = family._call

    def call(transformer, latents, *rest):
        mixed.append((transformer is loaded.pipe.transformer, latents.shape[0]))
        return real(transformer, latents, *rest)

    family._call = call
    images = run_plan(StepEngine(family), plan)
    check(loaded, pipelines, images, plan)
    # Some forward carried rows of both experts: a low-noise expert call and a high-noise one
    # in the same step, each with only its rows.
    assert (True, 2) in mixed and (False, 2) in mixed


def test_image_to_video_equals_the_pipeline_alone():
    loaded, pipelines, family = setup("tiny-wan-i2v")
    assert "generate" not in pipelines and "image-to-video" in pipelines
    first, _ = sample_image(32, seed=1)
    second, _ = sample_image(32, seed=2)
    a = video("tiny-wan-i2v", steps=4, seed=7, task="image-to-video")
    b = video("tiny-wan-i2v", steps=5, seed=8, task="image-to-video", guidance=1.0)
    plan = {0: [(a, [first])], 1: [(b, [second])]}
    images = run_plan(StepEngine(family), plan)
    check(loaded, pipelines, images, plan)


def test_request_mode_answers_frames_for_video_pipelines():
    loaded, pipelines, family = setup("tiny-wan")
    a, b = video("tiny-wan", seed=1), video("tiny-wan", seed=2, prompt="another")
    runner = RequestRunner(loaded, pipelines, family)
    outcomes = runner.execute(Work(1, [WorkItem(a, 0, 1), WorkItem(b, 0, 1)]), [[], []])
    for request, outcome in zip((a, b), outcomes):
        assert outcome.error is None, outcome.error
        assert max_diff(outcome.images, solo(loaded, pipelines, request)) <= TOLERANCE
