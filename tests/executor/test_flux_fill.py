"""FLUX.1 Fill in the step engine: inpainting and outpainting (a border to fill) whose masked image
and mask travel per row beside the latents, requests joining mid-run and sharing forwards (LoRA
adapters per row too), each equal to ``FluxFillPipeline`` called alone; and the same in request
mode."""

from __future__ import annotations

import numpy as np
import pytest

from diffserve.config.flags import ServerConfig
from diffserve.executor.checks.reference import max_diff, sample_image, solo
from diffserve.executor.runtime import build_runtime
from helpers import make_request, run_plan

MODEL = "tiny-flux-fill"


@pytest.fixture(scope="module")
def runtime():
    return build_runtime(ServerConfig(model=MODEL, batching_mode="step"), torch_threads=1)


def fill(rid: str, seed: int, **kw):
    return make_request(request_id=rid, model=MODEL, task="inpaint", seed=seed, **kw)


def border(size: int, width: int) -> np.ndarray:
    """An outpainting mask: everything but the centre (the picture shrunk into it) is redrawn."""
    mask = np.full((size, size), 255, np.uint8)
    mask[width:size - width, width:size - width] = 0
    return mask


def test_the_model_only_inpaints(runtime):
    assert runtime.info.tasks == ["inpaint"]  # no text-to-image: its pipeline needs an image
    assert runtime.task_modes == {"inpaint": "step"}  # the start-up check passed


def test_staggered_inpaintings_and_outpaintings_equal_the_pipeline_alone(runtime):
    rt = runtime
    picture, mask = sample_image(64)
    other, _ = sample_image(64, seed=1)
    framed = np.zeros_like(other)
    framed[16:48, 16:48] = other[::2, ::2]  # the picture shrunk, a border around it to fill
    plan = {
        0: [(fill("a", 1, prompt="a red circle", steps=5, guidance=30.0), [picture, mask])],
        1: [(fill("out", 2, prompt="a wide landscape around it", steps=4, guidance=10.0, n=2),
             [framed, border(64, 16)])],
        2: [(fill("half", 3, prompt="x", steps=6, strength=0.6, guidance=3.5),
             [other, np.ascontiguousarray(mask[::-1].T)]),
            # Another size: a running set of its own beside the others.
            (fill("wide", 4, prompt="wider", steps=4, guidance=30.0, width=96),
             [np.ascontiguousarray(np.concatenate([picture, other[:, :32]], axis=1)),
              np.ascontiguousarray(np.concatenate([mask, mask[:, :32]], axis=1))])],
    }
    rows, real = [], rt.family.forward

    def forward(latents, *rest, **host):
        rows.append(latents.shape[0])
        return real(latents, *rest, **host)

    rt.family.forward = forward
    try:
        images = run_plan(rt.step_engine(), plan)
    finally:
        rt.family.forward = real
    assert max(rows) >= 4  # the three requests' four images shared forwards
    for group in plan.values():
        for r, (image, m) in group:
            expected = solo(rt.loaded, rt.pipelines, r, image, m)
            assert max_diff(images[r.request_id], expected) <= 2, r.request_id
    # The model looked at the mask: the same request with another mask differs.
    again = run_plan(rt.step_engine(), {0: [(fill("a", 1, prompt="a red circle", steps=5,
                                                  guidance=30.0), [picture, border(64, 8)])]})
    assert max_diff(again["a"], images["a"]) > 2


def test_fills_in_request_mode_equal_the_pipeline_alone(runtime):
    from diffserve.wire.request import Work, WorkItem

    rt = runtime
    picture, mask = sample_image(64, seed=4)
    requests = [fill(f"r{i}", 10 + i, prompt=f"fill {i}", steps=3, guidance=30.0, n=1 + i % 2)
                for i in range(2)]
    frames = [[picture, mask], [np.ascontiguousarray(picture[::-1]), border(64, 16)]]
    outcomes = rt.request_runner().execute(Work(1, [WorkItem(r, 0, r.n) for r in requests]),
                                           frames)
    for r, (image, m), o in zip(requests, frames, outcomes):
        assert o.error is None, o.error
        assert max_diff(o.images, solo(rt.loaded, rt.pipelines, r, image, m)) <= 2, r.request_id


def test_lora_adapters_apply_per_row_in_one_running_set(runtime, tmp_path):
    """A denoiser LoRA on some fills and not others, in one forward: each equals
    ``FluxFillPipeline`` alone after ``load_lora_weights`` and ``set_adapters``."""
    from types import SimpleNamespace

    from diffusers import DiffusionPipeline

    from diffserve.builders.random.loras import write_lora
    from diffserve.builders.registry import resolve_model
    from diffserve.executor.checks.reference import with_adapters
    from diffserve.executor.lora.store import AdapterStore
    from diffserve.executor.step.engine import StepEngine

    rt = runtime
    path = write_lora(MODEL, tmp_path / "A", rank=4, seed=1)
    store = AdapterStore(rt.loaded.pipe, max_resident=2, max_rank=16)
    store.add("A", path)
    reference = DiffusionPipeline.from_pretrained(resolve_model(MODEL))
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(path, adapter_name="A")
    picture, mask = sample_image(64, seed=5)
    plan = {0: [(fill("plain", 1, prompt="a cat", steps=4, guidance=30.0), [picture, mask]),
                (fill("lora", 1, prompt="a cat", steps=4, guidance=30.0, loras=(("A", 1.0),)),
                 [picture, mask]),
                (fill("half", 2, prompt="a dog", steps=4, guidance=30.0, loras=(("A", 0.5),)),
                 [picture, border(64, 16)])]}
    try:
        images = run_plan(StepEngine(rt.family, adapters=store), plan)
    finally:
        store.remove("A")  # the module's model as it was for any later test
    for r, (image, m) in plan[0]:
        pipe = with_adapters(reference, list(r.loras))
        expected = solo(SimpleNamespace(pipe=pipe, call_kwargs=rt.loaded.call_kwargs), {}, r,
                        image, m)
        assert max_diff(images[r.request_id], expected) <= 2, r.request_id
    assert max_diff(images["lora"], images["plain"]) > 8  # the adapter changes the image
