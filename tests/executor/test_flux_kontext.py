"""FLUX.1 Kontext in the step engine and in request mode: generations at the size asked for, and
instruction edits whose reference image's tokens travel per row, each equal to the plain
pipeline run alone (``max_area`` = the size, the fitted input taken as it is)."""

from __future__ import annotations

import numpy as np
import pytest

from diffserve.executor.runtime import build_runtime
from diffserve.config.flags import ServerConfig
from diffserve.wire.request import Work, WorkItem
from helpers import make_request, run_plan
from diffserve.executor.checks.reference import max_diff, sample_image, solo

MODEL = "tiny-flux-kontext"


@pytest.fixture(scope="module")
def runtime():
    return build_runtime(ServerConfig(model=MODEL, batching_mode="step"), torch_threads=1)


def edit(rid: str, seed: int, **kw):
    return make_request(request_id=rid, model=MODEL, task="edit", seed=seed, references=1, **kw)


def test_the_model_edits_by_instruction_and_generates(runtime):
    assert runtime.info.tasks == ["generate", "edit", "rollout"]  # no image-to-image by strength
    assert runtime.info.max_edit_images == 1


def test_staggered_edits_and_generations_equal_their_solo_pipeline_runs(runtime):
    rt = runtime
    picture, _ = sample_image(64)
    other = np.ascontiguousarray(picture[::-1])
    wide = np.ascontiguousarray(np.concatenate([picture, other], axis=1)[:, :96])
    gen = lambda rid, **kw: make_request(request_id=rid, model=MODEL, **kw)  # noqa: E731
    plan = {
        0: [(gen("g1", prompt="a red circle", seed=1, steps=5, guidance=2.5), []),
            (edit("e1", 2, prompt="make it blue", steps=4, guidance=3.0), [picture])],
        2: [(edit("e2", 3, prompt="a much longer instruction: turn the square into a cat", steps=6,
                  guidance=1.5, n=2), [other]),
            (gen("g2", prompt="x", seed=4, steps=3, guidance=4.0), [])],
        3: [(edit("wide", 5, prompt="wider", steps=4, width=96), [wide])],
    }
    images = run_plan(rt.step_engine(), plan)
    for group in plan.values():
        for r, frames in group:
            expected = solo(rt.loaded, rt.pipelines, r, references=frames or None)
            assert max_diff(images[r.request_id], expected) <= 2, r.request_id
    # The edits did look at their images: the same instruction over another image differs
    # (little, with random weights: the point is that it does at all).
    inverted = np.ascontiguousarray(255 - picture)
    again = run_plan(rt.step_engine(), {0: [(edit("e1", 2, prompt="make it blue", steps=4,
                                                  guidance=3.0), [inverted])]})
    assert max_diff(again["e1"], images["e1"]) > 2


def test_edits_admitted_together_encode_their_images_in_one_vae_call(runtime):
    rt, calls = runtime, []
    vae = rt.family.pipe.vae
    real = vae.encode
    vae.encode = lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k)
    picture, _ = sample_image(64)
    other = np.ascontiguousarray(255 - picture)
    wide = np.ascontiguousarray(np.concatenate([picture, other], axis=1)[:, :96])
    plan = {0: [(edit("a", 1, prompt="make it blue", steps=3), [picture]),
                (edit("b", 2, prompt="make it red", steps=3, n=2), [other]),
                (edit("c", 3, prompt="wider", steps=3, width=96), [wide])]}
    try:
        images = run_plan(rt.step_engine(), plan)
    finally:
        vae.encode = real
    assert sorted(calls) == [1, 2]  # the two 64x64 inputs in one call, the wide one alone
    for r, frames in plan[0]:
        expected = solo(rt.loaded, rt.pipelines, r, references=frames)
        assert max_diff(images[r.request_id], expected) <= 2, r.request_id


def test_request_mode_batches_edits_of_several_requests_in_one_call(runtime):
    rt = runtime
    picture, _ = sample_image(64, seed=3)
    requests = [edit(f"r{i}", 10 + i, prompt=f"edit {i}", steps=3, n=1 + i % 2) for i in range(3)]
    frames = [[np.ascontiguousarray(np.roll(picture, 8 * i, axis=1))] for i in range(3)]
    calls, runner = [], rt.request_runner()  # it reads what the pipeline's __call__ takes
    pipe_call = type(rt.loaded.pipe).__call__

    def counted(pipe, *args, **kwargs):
        calls.append(len(kwargs["prompt"]))
        return pipe_call(pipe, *args, **kwargs)

    type(rt.loaded.pipe).__call__ = counted
    try:
        outcomes = runner.execute(Work(1, [WorkItem(r, 0, r.n) for r in requests]), frames)
    finally:
        type(rt.loaded.pipe).__call__ = pipe_call
    assert calls == [4]  # one call, every image
    for r, f, o in zip(requests, frames, outcomes):
        assert o.error is None, o.error
        assert max_diff(o.images, solo(rt.loaded, rt.pipelines, r, references=f)) <= 2
    gen = make_request(request_id="g", model=MODEL, seed=3, steps=2)
    (o,) = rt.request_runner().execute(Work(2, [WorkItem(gen, 0, 1)]), [[]])
    assert o.images.shape == (1, 64, 64, 3)  # not the pipeline's default 1024x1024
