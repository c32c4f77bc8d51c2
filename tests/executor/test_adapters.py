"""LoRA adapters in both engines, in process (tiny-sd): requests with different adapters, scales
and stacks share one forward in step mode, and every image equals plain diffusers run alone after
``load_lora_weights`` and ``set_adapters``; versions, eviction and bad files."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import save_file

from diffserve.executor.lora.store import AdapterError, AdapterStore
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

# A: rank 4; B: rank 16; C: with text-encoder weights; D: another A for replacing it.
SPECS = {"A": dict(rank=4, seed=1), "B": dict(rank=16, seed=2),
         "C": dict(rank=4, seed=3, text_encoder=True), "D": dict(rank=4, seed=4)}
STACKS = [(), (("A", 1.0),), (("B", 1.0),), (("A", 0.5),), (("A", 0.6), ("B", 0.8)), (("C", 1.0),)]


@pytest.fixture(scope="module")
def lora_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {name: write_lora("tiny-sd", root / name, **spec) for name, spec in SPECS.items()}


@pytest.fixture(scope="module")
def reference(lora_paths):
    """Plain diffusers with every adapter loaded under its name."""
    pipe = DiffusionPipeline.from_pretrained(resolve_model("tiny-sd"))
    pipe.set_progress_bar_config(disable=True)
    for name, path in lora_paths.items():
        pipe.load_lora_weights(path, adapter_name=name)
    return pipe


def expected(reference, request):
    pipe = with_adapters(reference, [(n, s) for n, s in request.loras])
    return solo(SimpleNamespace(pipe=pipe, call_kwargs={}), {}, request)


def engine_parts(lora_paths, max_resident=8, names=("A", "B", "C")):
    loaded = load_model("tiny-sd", torch_threads=1)
    pipelines = task_pipelines(loaded.pipe)
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    store = AdapterStore(loaded.pipe, max_resident, max_rank=64)
    for name in names:
        store.add(name, lora_paths[name])
    return loaded, pipelines, family, store


def run_steps(engine, plan, limit=100):
    """Admit ``plan[step]`` (requests) before that step; run until empty. {request_id: images}."""
    images, step, samples = {}, 0, []
    while step == 0 or engine:
        assert step < limit
        if step in plan:
            assert not engine.admit([WorkItem(r, 0, r.n) for r in plan[step]], [[]] * len(plan[step]))
        out = engine.step()
        samples.append(out.samples)
        for o in out.finished:
            assert o.error is None, o.error
            images[o.item.request.request_id] = o.images
        step += 1
    return images, samples


def test_different_adapters_scales_and_stacks_share_forwards_and_are_exact(lora_paths, reference):
    _, _, family, store = engine_parts(lora_paths)
    engine = StepEngine(family, adapters=store)
    requests = [make_request(request_id=f"r{i}", seed=10 + i, steps=5 + i % 3, loras=stack,
                             negative_prompt="dark" if i % 2 else "", guidance=4.0 + i % 3)
                for i, stack in enumerate(STACKS + [(("B", -0.7), ("C", 0.5)), (("A", 1.0),)])]
    plan = {0: requests[:3], 1: requests[3:6], 3: requests[6:]}
    images, samples = run_steps(engine, plan)
    assert max(samples) == len(requests)  # every one of them in one forward at some step
    for r in requests:
        assert max_diff(images[r.request_id], expected(reference, r)) <= 2, (r.request_id, r.loras)
    alone = expected(reference, requests[0])
    assert max_diff(expected(reference, requests[1]), alone) > 10  # the adapters change images
    assert max_diff(expected(reference, requests[5]), alone) > 10  # C's text encoder too
    assert store.resident == 3 and all(v.holders == 0 for v in store._versions.values())


def test_request_mode_applies_one_stack_per_call_and_is_exact(lora_paths, reference):
    loaded, pipelines, family, store = engine_parts(lora_paths)
    runner = RequestRunner(loaded, pipelines, family, adapters=store)
    for i, stack in enumerate(STACKS[1:]):
        batch = [make_request(request_id=f"q{i}-{j}", seed=20 + j, loras=stack, n=1 + j % 2)
                 for j in range(2)]  # the scheduler groups by stack: one stack per call
        outcomes = runner.execute(Work(i, [WorkItem(r, 0, r.n) for r in batch]), [[], []])
        for r, o in zip(batch, outcomes):
            assert o.error is None and max_diff(o.images, expected(reference, r)) <= 2, r.loras


def test_a_replaced_adapter_keeps_its_old_version_for_the_requests_running_on_it(lora_paths, reference):
    _, _, family, store = engine_parts(lora_paths, names=("A",))
    engine = StepEngine(family, adapters=store)
    old = make_request(request_id="old", seed=1, steps=8, loras=(("A", 1.0),))
    engine.admit([WorkItem(old, 0, 1)], [[]])
    engine.step()
    store.add("A", lora_paths["D"])  # a trainer pushes new weights under the same name
    new = make_request(request_id="new", seed=1, steps=4, loras=(("A", 1.0),))
    images, _ = run_steps(engine, {0: [new]})
    assert max_diff(images["old"], expected(reference, old)) <= 2  # A as it started: version 1
    as_d = make_request(request_id="d", prompt=new.prompt, seed=1, steps=4, loras=(("D", 1.0),))
    assert max_diff(images["new"], expected(reference, as_d)) <= 2  # admitted after: version 2
    assert store.resident == 1  # the old version went once its last request left


def test_eviction_keeps_at_most_max_resident_and_never_what_runs(lora_paths, reference):
    _, _, family, store = engine_parts(lora_paths, max_resident=2, names=("A", "B", "C"))
    assert store.resident == 2
    engine = StepEngine(family, adapters=store)
    asked = [make_request(request_id=f"e{i}", seed=i, steps=6, loras=((name, 1.0),))
             for i, name in enumerate(["A", "B", "C", "A"])]
    plan = {0: asked[:2], 1: asked[2:]}  # C and A must wait until A or B leaves
    images, _ = run_steps(engine, plan)
    for r in asked:
        assert max_diff(images[r.request_id], expected(reference, r)) <= 2, r.request_id
    assert store.resident <= 2


@pytest.mark.parametrize("make_bad, reason", [
    (lambda d: save_file({"x": torch.zeros(3)}, str(d / "f.safetensors")) or d / "f.safetensors",
     "Invalid LoRA checkpoint"),
    (lambda d: save_file({"unet.no_such_block.to_q.lora_A.weight": torch.ones(4, 32),
                          "unet.no_such_block.to_q.lora_B.weight": torch.ones(32, 4)},
                         str(d / "k.safetensors")) or d / "k.safetensors",
     "no_such_block"),
    (lambda d: (d / "t.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":") or
     d / "t.safetensors", "is not a LoRA adapter"),
    (lambda d: write_lora("tiny-sdxl", d / "sdxl", rank=4), "does not fit|is not a LoRA"),
])
def test_a_file_that_is_not_a_lora_of_this_model_is_refused_with_the_reason(
        lora_paths, reference, tmp_path, make_bad, reason):
    loaded, _, family, store = engine_parts(lora_paths, names=("A",))
    with pytest.raises(AdapterError, match=reason) as error:
        store.add("bad", str(make_bad(tmp_path)))
    assert error.value.status == 400 and "bad" not in store.current
    engine = StepEngine(family, adapters=store)  # still serves, exactly
    r = make_request(request_id="ok", seed=3, loras=(("A", 1.0),))
    images, _ = run_steps(engine, {0: [r]})
    assert max_diff(images["ok"], expected(reference, r)) <= 2


def test_rank_above_the_bound_is_refused(lora_paths):
    _, _, _, store = engine_parts(lora_paths, names=())
    store.max_rank = 8
    with pytest.raises(AdapterError, match="rank 16"):
        store.add("B", lora_paths["B"])
    assert store.resident == 0


def test_loading_for_a_stack_never_evicts_another_adapter_of_the_same_stack(lora_paths, reference):
    """--max-loras 2 with C and B resident and idle, C the less recently used: a request for
    [C, A] loads A in place of B, never of C, which it holds too."""
    _, _, family, store = engine_parts(lora_paths, max_resident=2, names=("A", "B", "C"))
    store.release(store.acquire((("B", 1.0),)))  # B used after C
    resident = lambda: {v.name for v in store._versions.values() if v.resident}  # noqa: E731
    assert resident() == {"B", "C"}
    engine = StepEngine(family, adapters=store)
    r = make_request(request_id="ca", seed=5, steps=3, loras=(("C", 0.6), ("A", 0.7)))
    images, _ = run_steps(engine, {0: [r]})
    assert max_diff(images["ca"], expected(reference, r)) <= 2
    assert resident() == {"C", "A"}


def test_a_dora_adapter_is_refused_at_load_with_the_reason(lora_paths, tmp_path):
    _, _, _, store = engine_parts(lora_paths, names=("A",))
    path = write_lora("tiny-sd", tmp_path / "dora", rank=4, seed=5, dora=True)
    with pytest.raises(AdapterError, match="DoRA") as error:
        store.add("dora", path)
    assert error.value.status == 400 and "dora" not in store.current and store.resident == 1
