"""LoRA adapters on SDXL, SD3 and Flux in both engines, in process: a denoiser adapter and one
that also adapts the CLIP text encoders (SDXL and SD3: both of them), alone, scaled and stacked,
in one running set with requests without adapters. Every image equals the plain diffusers
pipeline run alone after ``load_lora_weights`` and ``set_adapters`` (within 2/255), and each
adapter visibly changes the image, so a wrong row or a leaking scale fails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from diffusers import DiffusionPipeline

from diffserve.executor.lora.store import AdapterStore
from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.request.runner import RequestRunner
from diffserve.executor.step.engine import StepEngine
from diffserve.builders.registry import resolve_model
from diffserve.wire.request import Work, WorkItem
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, solo, with_adapters
from diffserve.builders.random.loras import write_lora


@pytest.fixture(scope="module", params=["tiny-sdxl", "tiny-sd3", "tiny-flux"])
def setup(request, tmp_path_factory):
    model = request.param
    root = tmp_path_factory.mktemp(model)
    paths = {"A": write_lora(model, root / "A", rank=4, seed=1),
             "T": write_lora(model, root / "T", rank=8, seed=2, text_encoder=True)}
    loaded = load_model(model, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe)
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    store = AdapterStore(loaded.pipe, max_resident=4, max_rank=64)
    for name, path in paths.items():
        store.add(name, path)
    reference = DiffusionPipeline.from_pretrained(resolve_model(model))
    reference.set_progress_bar_config(disable=True)
    for name, path in paths.items():
        reference.load_lora_weights(path, adapter_name=name)
    return SimpleNamespace(model=model, loaded=loaded, pipelines=pipelines, family=family,
                           store=store, reference=reference)


def expected(s, request):
    pipe = with_adapters(s.reference, list(request.loras))
    return solo(SimpleNamespace(pipe=pipe, call_kwargs=s.loaded.call_kwargs), {}, request)


def requests(model: str):
    """Four stacks, with guidance and a negative prompt where the family has them."""
    kw = {} if model == "tiny-flux" else {"negative_prompt": "dull"}
    return [make_request(request_id="base", model=model, seed=1, steps=5),
            make_request(request_id="a", model=model, seed=2, steps=4, loras=(("A", 1.0),)),
            make_request(request_id="a+t", model=model, seed=3, steps=5, guidance=3.0,
                         loras=(("A", 0.5), ("T", 0.8)), **kw),
            make_request(request_id="t", model=model, seed=4, steps=4, loras=(("T", 1.0),))]


def stepped(engine) -> tuple[dict, list[int]]:
    """Step ``engine`` to the end: each request's images, and the images each forward carried."""
    images, carried = {}, []
    while engine:
        out = engine.step()
        carried.append(out.samples)
        images.update({o.item.request.request_id: o.images for o in out.finished
                       if o.error is None})
    return images, carried


def test_step_mode_shares_forwards_across_stacks_and_is_exact(setup):
    engine = StepEngine(setup.family, adapters=setup.store)
    plan = requests(setup.model)
    assert not engine.admit([WorkItem(r, 0, 1) for r in plan[:2]], [[], []])
    engine.step()
    assert not engine.admit([WorkItem(r, 0, 1) for r in plan[2:]], [[], []])  # join at step 1
    images, carried = stepped(engine)
    assert max(carried) == 4  # all four stacks in one forward
    for r in plan:
        assert max_diff(images[r.request_id], expected(setup, r)) <= 2, r.request_id
    base = solo(SimpleNamespace(pipe=with_adapters(setup.reference, []),
                                call_kwargs=setup.loaded.call_kwargs), {},
                make_request(request_id="t-base", model=setup.model, seed=4, steps=4))
    assert max_diff(images["t"], base) > 8  # the adapters change images visibly


def test_request_mode_applies_one_stack_per_call_and_is_exact(setup):
    runner = RequestRunner(setup.loaded, setup.pipelines, setup.family, adapters=setup.store)
    for i, r in enumerate(requests(setup.model)[1:]):
        batch = [r, make_request(request_id=f"{r.request_id}-2", model=setup.model, seed=9,
                                 steps=r.num_inference_steps, guidance=r.guidance_scale,
                                 negative_prompt=r.negative_prompt, loras=r.loras)]
        outcomes = runner.execute(Work(i, [WorkItem(q, 0, 1) for q in batch]), [[], []])
        for q, o in zip(batch, outcomes):
            assert o.error is None, o.error
            assert max_diff(o.images, expected(setup, q)) <= 2, (q.request_id, q.loras)


def test_step_mode_mixes_sizes_and_stacks_in_one_forward(setup):
    """Where the family mixes sizes (Flux), each row keeps its adapters at its own size."""
    if setup.model != "tiny-flux":
        pytest.skip("a family whose rows of different sizes share a forward")
    import dataclasses

    sizes = [(64, 64), (96, 64), (48, 48), (64, 96)]
    plan = [dataclasses.replace(r, width=w, height=h)
            for r, (w, h) in zip(requests(setup.model), sizes)]
    engine = StepEngine(setup.family, adapters=setup.store, mixed_sizes=frozenset({"generate"}))
    assert not engine.admit([WorkItem(r, 0, 1) for r in plan], [[]] * len(plan))
    images, carried = stepped(engine)
    assert carried[0] == 4  # four sizes, four stacks, one forward
    for r in plan:
        assert max_diff(images[r.request_id], expected(setup, r)) <= 2, r.request_id
