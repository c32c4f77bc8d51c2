"""LoRA adapters on the video families whose diffusers pipeline takes them (LTX-2, Wan), in the
step engine, in process: rows with and without adapters, scaled and stacked, in one forward.
Every video equals the plain diffusers pipeline run alone after ``load_lora_weights`` and
``set_adapters`` (frames within 2/255), and an adapter visibly changes the video, so a wrong
row or a leaking scale fails. LTX-2's adapter also adapts its audio attention (the targets
match by name), so the sound must follow the row's adapters too."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from diffusers import DiffusionPipeline
from helpers import make_request

from diffserve.builders.random.loras import write_lora
from diffserve.builders.registry import resolve_model
from diffserve.executor.checks.reference import max_diff, solo, with_adapters
from diffserve.executor.families.known import family_for
from diffserve.executor.lora.store import AdapterStore
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.step.engine import StepEngine
from diffserve.wire.request import WorkItem

WAVE_TOLERANCE = 1e-4  # as tests/executor/test_ltx2.py's


@pytest.fixture(scope="module", params=["tiny-ltx2", "tiny-wan"])
def setup(request, tmp_path_factory):
    model = request.param
    root = tmp_path_factory.mktemp(model)
    paths = {"A": write_lora(model, root / "A", rank=4, seed=1),
             "B": write_lora(model, root / "B", rank=8, seed=2)}
    loaded = load_model(model, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe, family_for(loaded.pipeline_class))
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    store = AdapterStore(loaded.pipe, max_resident=4, max_rank=64)
    for name, path in paths.items():
        store.add(name, path)
    reference = DiffusionPipeline.from_pretrained(resolve_model(model))
    reference.set_progress_bar_config(disable=True)
    for name, path in paths.items():
        reference.load_lora_weights(path, adapter_name=name)
    return SimpleNamespace(model=model, loaded=loaded, family=family, store=store,
                           reference=reference, sound=model == "tiny-ltx2")


def video(model: str, **fields):
    fields.setdefault("width", 32)
    fields.setdefault("height", 32)
    return dataclasses.replace(make_request(model=model, **fields), num_frames=9)


def expected(s, request, loras=None):
    pipe = with_adapters(s.reference, list(request.loras if loras is None else loras))
    return solo(SimpleNamespace(pipe=pipe, call_kwargs=s.loaded.call_kwargs), {}, request,
                sound=s.sound)


def test_rows_with_and_without_adapters_share_forwards_and_are_exact(setup):
    m = setup.model
    plan = [video(m, request_id="base", seed=1, steps=4, guidance=3.0),
            video(m, request_id="a", seed=2, steps=4, guidance=3.0, loras=(("A", 1.0),)),
            video(m, request_id="a+b", seed=3, steps=4, guidance=4.0,
                  loras=(("A", 0.5), ("B", 0.8))),
            video(m, request_id="b", seed=4, steps=3, guidance=3.0, loras=(("B", 1.0),))]
    engine = StepEngine(setup.family, adapters=setup.store)
    assert not engine.admit([WorkItem(r, 0, 1) for r in plan], [[]] * len(plan))
    outcomes, carried = {}, []
    while engine:
        out = engine.step()
        carried.append(out.samples)
        for o in out.finished:
            assert o.error is None, o.error
            outcomes[o.item.request.request_id] = o
    assert max(carried) == 4  # all four stacks in one forward
    for r in plan:
        want = expected(setup, r)
        frames, wave = want if setup.sound else (want, None)
        got = outcomes[r.request_id]
        assert max_diff(got.images, frames) <= 2, r.request_id
        if setup.sound:
            assert np.abs(got.audio - wave).max() <= WAVE_TOLERANCE, r.request_id
    plain = expected(setup, plan[3], loras=())
    plain = plain[0] if setup.sound else plain
    assert max_diff(outcomes["b"].images, plain) > 8  # the adapter changes the video visibly


def test_a_pipeline_without_a_lora_loader_refuses_adapters_at_start():
    """HunyuanVideo 1.5's pipelines have no LoRA loader in diffusers 0.42: the server says so
    at start rather than failing on the first adapter's file."""
    from diffusers import HunyuanVideo15Pipeline

    from diffserve.config.flags import ServerConfig
    from diffserve.executor.lora.store import served_adapters

    pipe = HunyuanVideo15Pipeline.__new__(HunyuanVideo15Pipeline)
    config = ServerConfig(enable_lora_runtime_updates=True, lora_dir="/tmp")
    with pytest.raises(RuntimeError, match="HunyuanVideo15Pipeline has no LoRA loader"):
        served_adapters(pipe, config)
