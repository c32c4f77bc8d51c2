"""LTX-2 in the step engine: every video and its sound track equal the plain diffusers pipeline
called alone (frames within 2/255 before encoding; after H.264, the served MP4 >= 35 dB against
the pipeline's frames through the same encoder (the tiny VAE's noise-like 32x32 frames lose
about 18 dB to 4:2:0 chroma whoever made them); the waveform within WAVE_TOLERANCE before
encoding), with requests of different steps, guidance, seeds, sizes and
frame counts joining at different steps; rows of one size share forwards."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_request, psnr, rows_per_forward

from diffserve.executor.checks.reference import max_diff, solo
from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.step.engine import StepEngine

TOLERANCE = 2
# The sound before encoding: float32 sums in another order (the engine's batched forward, its
# guidance on velocities where the pipeline guides the denoised estimate).
WAVE_TOLERANCE = 1e-4
MIN_PSNR = 35.0


@pytest.fixture(scope="module")
def model():
    loaded = load_model("tiny-ltx2", torch_threads=1)
    pipelines = task_pipelines(loaded.pipe, family_for(loaded.pipeline_class))
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    return loaded, pipelines, family


def video(frames: int = 9, **fields):
    import dataclasses

    fields.setdefault("width", 32)
    fields.setdefault("height", 32)
    return dataclasses.replace(make_request(model="tiny-ltx2", **fields), num_frames=frames)


def run(engine, plan: dict) -> dict:
    """Each request's outcome (frames and sound), by request id."""
    from diffserve.wire.request import WorkItem

    outcomes, step = {}, 0
    while step == 0 or engine:
        if step in plan:
            failed = engine.admit([WorkItem(r, 0, r.n) for r in plan[step]],
                                  [[] for _ in plan[step]])
            assert not failed, [f.error for f in failed]
        for o in engine.step().finished:
            assert o.error is None, o.error
            outcomes[o.item.request.request_id] = o
        step += 1
    return outcomes


def test_videos_with_sound_equal_the_pipeline_alone(model, tmp_path):
    from diffserve.frontend.videos.encode import decode_mp4, encode_mp4

    loaded, pipelines, family = model
    a = video(steps=6, guidance=4.0, seed=1)
    b = video(steps=4, guidance=3.0, seed=2, negative_prompt="blurry")
    c = video(steps=5, guidance=1.0, seed=3)  # no guidance: one row
    d = video(frames=5, steps=4, seed=4, width=64)  # another running set
    plan = {0: [a], 2: [b, d], 3: [c]}
    with rows_per_forward(family) as shared:
        outcomes = run(StepEngine(family), plan)
    assert max(shared) >= 4  # a's and b's guided rows shared forwards
    for request in (a, b, c, d):
        got = outcomes[request.request_id]
        frames, wave = solo(loaded, pipelines, request, sound=True)
        assert got.images.shape == frames.shape == (1, request.num_frames, request.height,
                                                    request.width, 3)
        assert max_diff(got.images, frames) <= TOLERANCE
        assert got.sample_rate == loaded.pipe.vocoder.config.output_sampling_rate
        assert got.audio.shape == wave.shape and wave.shape[:2] == (1, 2)
        assert np.abs(got.audio - wave).max() <= WAVE_TOLERANCE
        served, alone = (tmp_path / f"{request.request_id}{n}.mp4" for n in ("", "-alone"))
        encode_mp4(got.images[0], 24, served)
        encode_mp4(frames[0], 24, alone)
        assert psnr(decode_mp4(served), decode_mp4(alone)) >= MIN_PSNR


def test_image_to_video_shares_forwards_with_text_to_video(model):
    """LTX2ImageToVideoPipeline over the same components: the first latent frame is the image's
    and stays clean; image-to-video and text-to-video rows share a forward."""
    from diffserve.executor.checks.reference import sample_image

    loaded, pipelines, family = model
    assert "image-to-video" in pipelines and "generate" in pipelines
    first, _ = sample_image(32, seed=1)
    a = video(steps=4, guidance=4.0, seed=5, task="image-to-video")
    b = video(steps=4, guidance=3.0, seed=6)
    c = video(steps=3, guidance=1.0, seed=7, task="image-to-video")
    from diffserve.wire.request import WorkItem

    engine, outcomes, rows = StepEngine(family), {}, []
    real = family.forward
    family.forward = lambda latents, *rest, **host: rows.append(latents.shape[0]) or real(
        latents, *rest, **host)
    try:
        failed = engine.admit([WorkItem(r, 0, 1) for r in (a, b, c)],
                              [[first], [], [first]])
        assert not failed, [f.error for f in failed]
        while engine:
            for o in engine.step().finished:
                assert o.error is None, o.error
                outcomes[o.item.request.request_id] = o
    finally:
        family.forward = real
    assert max(rows) == 5  # a's and b's guided rows and c's one, in one forward
    for request, image in ((a, first), (b, None), (c, first)):
        got = outcomes[request.request_id]
        frames, wave = solo(loaded, pipelines, request, image=image, sound=True)
        assert max_diff(got.images, frames) <= TOLERANCE, request.request_id
        assert np.abs(got.audio - wave).max() <= WAVE_TOLERANCE, request.request_id
