"""HunyuanVideo 1.5 in the step engine: every video equals the plain diffusers pipeline called
alone (frames within 2/255 before encoding; after H.264 the served MP4 >= 35 dB against the
pipeline's frames through the same encoder), with requests of different steps, guidance,
seeds, sizes and frame counts joining at different steps; rows of one size share forwards; the
pipeline's guider takes each call's guidance scale."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import make_request, psnr, rows_per_forward, run_plan

from diffserve.executor.checks.reference import max_diff, solo
from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.step.engine import StepEngine

MODEL = "tiny-hunyuan-video15"
TOLERANCE = 2
MIN_PSNR = 35.0


@pytest.fixture(scope="module")
def model():
    loaded = load_model(MODEL, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe, family_for(loaded.pipeline_class))
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    return loaded, pipelines, family


def video(frames: int = 9, **fields):
    fields.setdefault("width", 32)
    fields.setdefault("height", 32)
    return dataclasses.replace(make_request(model=MODEL, **fields), num_frames=frames)


def test_videos_equal_the_pipeline_alone(model, tmp_path):
    from diffserve.frontend.videos.encode import decode_mp4, encode_mp4

    loaded, pipelines, family = model
    a = video(steps=4, guidance=6.0, seed=1)
    b = video(steps=3, guidance=3.0, seed=2, negative_prompt="blurry")
    c = video(steps=3, guidance=1.0, seed=3)  # no guidance: one row
    d = video(frames=5, steps=2, seed=4, width=48)  # another running set
    plan = {0: [(a, [])], 1: [(b, []), (d, [])], 2: [(c, [])]}
    with rows_per_forward(family) as shared:
        images = run_plan(StepEngine(family), plan)
    assert max(shared) >= 4  # a's and b's guided rows shared forwards
    for request in (a, b, c, d):
        expected = solo(loaded, pipelines, request)
        got = images[request.request_id]
        assert got.shape == expected.shape == (1, request.num_frames, request.height,
                                               request.width, 3)
        assert max_diff(got, expected) <= TOLERANCE, request.request_id
        served, alone = (tmp_path / f"{request.request_id}{n}.mp4" for n in ("", "-alone"))
        encode_mp4(got[0], 24, served)
        encode_mp4(expected[0], 24, alone)
        assert psnr(decode_mp4(served), decode_mp4(alone)) >= MIN_PSNR
    # The guider's own scale is back after each call that set the request's.
    assert loaded.pipe.guider.guidance_scale == 6.0
