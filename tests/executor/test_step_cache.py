"""The per-image step cache in the step engine, in process: threshold 0 changes nothing, an
image's result depends only on its own inputs and threshold (never on its batch-mates or
theirs), hits are counted, rows that hit leave the blocks after the first, and caches go with
the requests that hold them."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.accel.step_cache import StepCache, UnsupportedCache
from diffserve.executor.step.engine import StepEngine
from diffserve.wire.request import WorkItem
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, solo

# Every family the cache splits: UNets and transformers (tiny-z-image with a deeper main stack:
# the packaged one has a single block).
FAMILIES = ["tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-qwen-image", "tiny-z-image",
            "tiny-pixart-sigma", "tiny-sana", "tiny-wan22"]


def parts(model: str):
    loaded = load_model(model, torch_threads=1)
    if model == "tiny-z-image":
        main = loaded.pipe.transformer
        torch.manual_seed(0)
        loaded.pipe.transformer = type(main).from_config({**main.config, "n_layers": 3})
    pipelines = task_pipelines(loaded.pipe)
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    return loaded, pipelines, family, StepCache(family.denoisers)


def cached(request, threshold: float | None):
    return dataclasses.replace(request, cache_threshold=threshold)


def request_for(model: str, rid: str, threshold: float | None, **kw):
    video = model.startswith("tiny-wan")
    size = 32 if video else 64
    kw.setdefault("steps", 8)
    return cached(make_request(request_id=rid, model=model, width=size, height=size, **kw) if not
                  video else dataclasses.replace(
                      make_request(request_id=rid, model=model, width=size, height=size, **kw),
                      num_frames=5), threshold)


def run(engine: StepEngine, plan: dict[int, list], limit: int = 100):
    """Admit ``plan[step]`` before that step; run until empty. {id: outcome}, and the rows that
    hit and missed."""
    outcomes, step, hits, misses = {}, 0, 0, 0
    while step == 0 or engine:
        assert step < limit
        if step in plan:
            assert not engine.admit([WorkItem(r, 0, r.n) for r in plan[step]], [[]] * len(plan[step]))
        out = engine.step()
        hits, misses = hits + out.cache_hits, misses + out.cache_misses
        for o in out.finished:
            assert o.error is None, o.error
            outcomes[o.item.request.request_id] = o
        step += 1
    return outcomes, hits, misses


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, *parts(request.param)


def test_an_image_depends_only_on_its_own_inputs_and_threshold(family):
    model, _, _, fam, cache = family
    me = request_for(model, "me", 1.0, seed=3, prompt="a cat")
    alone, _, _ = run(StepEngine(fam, step_cache=cache), {0: [me]})
    mates = {0: [me, request_for(model, "b", 0.0, seed=4, n=2, guidance=3.0,
                                 prompt="a much longer prompt than the other ones",
                                 negative_prompt="blurry")],
             2: [request_for(model, "c", 0.3, seed=5, steps=5)]}
    among, hits, _ = run(StepEngine(fam, step_cache=cache), mates)
    assert alone["me"].cached_steps[0] > 0  # it did reuse its cache
    assert among["me"].cached_steps == alone["me"].cached_steps
    assert max_diff(among["me"].images, alone["me"].images) <= 1, model
    assert hits > 0


def test_threshold_zero_is_the_plain_step_engine_and_diffusers():
    loaded, pipelines, fam, cache = parts("tiny-flux")
    plan = lambda: {0: [cached(make_request(request_id="z", model="tiny-flux", seed=1, steps=6),  # noqa: E731
                               0.0), cached(make_request(request_id="d", model="tiny-flux", seed=2,
                                                         steps=5, n=2), None)]}
    with_cache, hits, misses = run(StepEngine(fam, step_cache=cache), plan())
    without, _, _ = run(StepEngine(fam), plan())
    assert hits == 0 and misses > 0
    for rid, outcome in without.items():
        assert max_diff(with_cache[rid].images, outcome.images) == 0
        assert with_cache[rid].cached_steps == [0] * outcome.item.request.n
        assert max_diff(outcome.images, solo(loaded, pipelines, outcome.item.request)) <= 2


def test_hits_are_counted_per_image_and_per_row():
    _, _, fam, cache = parts("tiny-sd")  # classifier-free guidance: two rows an image
    engine = StepEngine(fam, step_cache=cache, cache_threshold=1.0)  # the server's default
    a = make_request(request_id="a", seed=1, steps=10, n=2)  # takes the default
    b = cached(make_request(request_id="b", seed=2, steps=10), 0.0)
    outcomes, hits, misses = run(engine, {0: [a, b]})
    per_image = outcomes["a"].cached_steps
    assert len(per_image) == 2 and all(0 < s <= 10 - 2 for s in per_image)  # first, last compute
    assert outcomes["b"].cached_steps == [0]
    assert hits == 2 * sum(per_image) and hits + misses == 10 * 2 * 3


@pytest.mark.parametrize("model, probe", [
    ("tiny-flux", lambda d: d.single_transformer_blocks[0].norm),  # the last block's first layer
    ("tiny-sd", lambda d: d.mid_block.resnets[0]),  # the UNet's middle
])
def test_rows_that_hit_leave_the_remaining_blocks(model, probe):
    _, _, fam, cache = parts(model)
    seen: list[int] = []
    handle = probe(fam.denoiser).register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    try:
        engine = StepEngine(fam, step_cache=cache)
        rows = 2 if fam.uses_cfg(5.0, "") else 1
        outcomes, hits, misses = run(engine, {0: [request_for(model, "hit", 1.0, seed=1),
                                                  request_for(model, "miss", 0.0, seed=2)]})
    finally:
        handle.remove()
    assert hits > 0
    assert sum(seen) == misses  # every row computed there once a step, no hit row ever
    assert min(seen) == rows  # steps where one request hit carried the other's rows only
    alone_seen: list[int] = []
    handle = probe(fam.denoiser).register_forward_pre_hook(
        lambda m, args: alone_seen.append(args[0].shape[0]))
    try:
        outcomes, hits, _ = run(StepEngine(fam, step_cache=cache),
                                {0: [request_for(model, "only", 1.0, seed=1)]})
    finally:
        handle.remove()
    # A step where every row hits does not call the remaining blocks at all.
    assert len(alone_seen) == 8 - outcomes["only"].cached_steps[0] < 8


def test_caches_are_freed_on_retire_and_on_cancel():
    _, _, fam, cache = parts("tiny-flux")
    engine = StepEngine(fam, step_cache=cache)
    stay = request_for("tiny-flux", "stay", 0.5, seed=1, steps=4)
    go = request_for("tiny-flux", "go", 0.5, seed=2, steps=30)
    engine.admit([WorkItem(stay, 0, 1), WorkItem(go, 0, 1)], [[], []])
    engine.step()
    held = {u.request.request_id: weakref.ref(u.cache) for u in engine.units}
    assert engine.cache_bytes() > 0
    engine.cancel(["go"])
    out = engine.step()
    assert [o.status for o in out.finished] == ["cancelled"]
    while engine:
        engine.step()
    gc.collect()
    assert engine.cache_bytes() == 0
    assert held["stay"]() is None and held["go"]() is None  # nothing keeps either alive


def test_a_paused_request_keeps_its_cache():
    _, _, fam, cache = parts("tiny-flux")
    me = request_for("tiny-flux", "me", 1.0, seed=1, steps=10)
    plain, _, _ = run(StepEngine(fam, step_cache=cache), {0: [me]})
    engine = StepEngine(fam, step_cache=cache)
    engine.admit([WorkItem(me, 0, 1)], [[]])
    for _ in range(3):
        engine.step()
    engine.pause([("me", 0)])
    engine.step()  # it leaves the running set here, its state kept
    assert not engine.units and engine.paused
    engine.admit([WorkItem(me, 0, 1, resume=True)], [[]])
    finished = []
    while engine:
        finished += engine.step().finished
    (outcome,) = finished
    assert outcome.cached_steps == plain["me"].cached_steps
    assert max_diff(outcome.images, plain["me"].images) == 0


def test_adapters_follow_the_rows_that_compute(tmp_path):
    from diffserve.executor.lora.store import AdapterStore
    from diffserve.builders.random.loras import write_lora

    loaded, _, fam, cache = parts("tiny-sd")
    store = AdapterStore(loaded.pipe, 4, max_rank=64)
    store.add("A", write_lora("tiny-sd", tmp_path / "A", rank=4, seed=1))
    store.add("B", write_lora("tiny-sd", tmp_path / "B", rank=8, seed=2))
    me = request_for("tiny-sd", "me", 1.0, seed=1, loras=(("A", 0.8),))
    alone, _, _ = run(StepEngine(fam, adapters=store, step_cache=cache), {0: [me]})
    among, hits, _ = run(StepEngine(fam, adapters=store, step_cache=cache),
                         {0: [request_for("tiny-sd", "b", 0.0, seed=2, loras=(("B", 1.0),)), me,
                              request_for("tiny-sd", "c", 0.0, seed=3)]})
    assert hits > 0 and alone["me"].cached_steps[0] > 0
    assert max_diff(among["me"].images, alone["me"].images) <= 1


def test_a_denoiser_it_cannot_split_is_refused_with_its_name():
    loaded = load_model("tiny-z-image", torch_threads=1)  # one block in its main stack
    with pytest.raises(UnsupportedCache, match="ZImageTransformer2DModel"):
        StepCache([loaded.pipe.transformer])


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-z-image"])
def test_rows_of_different_sizes_cache_as_each_would_alone(model):
    """In a forward whose rows of several sizes are padded, an image's signal and cache cover
    its own tokens: its hits and pixels are those of its run alone."""
    loaded, _, family, cache = parts(model)
    sizes = [(64, 64), (96, 48), (48, 48)]
    plan = [cached(make_request(request_id=f"{w}x{h}", model=model, width=w, height=h, seed=i,
                                steps=8), 1.0) for i, (w, h) in enumerate(sizes)]
    alone = {}
    for r in plan:
        engine = StepEngine(family, step_cache=cache)
        done, hits, _ = run(engine, {0: [r]})
        alone[r.request_id] = (done[r.request_id].images, done[r.request_id].cached_steps, hits)
    assert sum(hits for *_, hits in alone.values()) > 0  # the threshold lets steps reuse
    engine = StepEngine(family, step_cache=cache, mixed_sizes=frozenset({"generate"}))
    done, hits, misses = run(engine, {0: plan})
    rows = 2 if family.uses_cfg(5.0, "") else 1
    assert hits + misses == 3 * 8 * rows  # one forward a step carried all three
    for r in plan:
        images, steps, _ = alone[r.request_id]
        assert done[r.request_id].cached_steps == steps, r.request_id
        assert max_diff(done[r.request_id].images, images) <= 1, r.request_id
