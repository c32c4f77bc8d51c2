"""--compile: the denoisers' repeated blocks compiled once per class, rows as a dynamic dimension
(exact) or padded to power-of-two buckets; images equal eager ones, and steady traffic compiles
nothing new.

The default suite traces with dynamo's "eager" backend (the same graphs, guards and buckets,
no code generation: seconds); the inductor cases, which generate and build C++ (minutes on a
small CPU), are marked slow."""

from __future__ import annotations

import pytest
import torch

from diffserve.executor.accel.compiled import (WASTE, CompiledBlocks, bucket, buckets,
                                               warm_up_forwards, warm_up_images)
from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.accel.step_cache import StepCache
from diffserve.executor.step.engine import StepEngine
from diffserve.wire.request import WorkItem
from helpers import make_request
from diffserve.executor.checks.reference import max_diff


def test_buckets_waste_at_most_a_quarter_of_their_rows():
    assert [bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 65, 81)] == [
        1, 2, 3, 4, 6, 8, 12, 16, 20, 40, 80, 104]
    assert buckets(64) == [1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    worst = max((bucket(r) - r) / bucket(r) for r in range(1, 4096))
    assert worst == WASTE  # 9 rows in 12; powers of two padded 9 to 16


def test_the_warm_up_reaches_each_bucket_once_and_records_cuda_graphs():
    from types import SimpleNamespace

    # Two rows an image (guidance): the buckets even rows reach, each once (3 never is).
    assert warm_up_images(2, 16, "buckets") == [1, 2, 3, 4, 5, 7]
    assert [bucket(2 * n) for n in warm_up_images(2, 16, "buckets")] == [2, 4, 6, 8, 12, 16]
    assert warm_up_images(1, 5, "buckets") == [1, 2, 3, 4, 5]
    assert warm_up_images(2, 16, "exact") == [1, 2] and warm_up_images(2, 3, "exact") == [1]
    assert warm_up_forwards(SimpleNamespace(copy=True)) == 3  # recorded at the second call
    assert warm_up_forwards(SimpleNamespace(copy=False)) == 1


def family_of(model: str):
    loaded = load_model(model, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe)
    return family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)


def traffic(model: str, tag: str):
    """Requests whose rows change from step to step (joins, leaves, n=3 with guidance)."""
    req = lambda rid, **kw: make_request(request_id=f"{tag}-{rid}", model=model,  # noqa: E731
                                         prompt=f"prompt {rid}", **kw)
    return {0: [req("a", seed=1, steps=5), req("b", seed=2, steps=3, n=3)],
            2: [req("c", seed=3, steps=4, guidance=1.0)]}


def run(engine, plan):
    images, step = {}, 0
    while step == 0 or engine:
        if step in plan:
            assert not engine.admit([WorkItem(r, 0, r.n) for r in plan[step]], [[]] * len(plan[step]))
        for o in engine.step().finished:
            assert o.error is None, o.error
            images[o.item.request.request_id.split("-", 1)[1]] = o.images
        step += 1
    return images


def check_compiled(model: str, backend: str, tolerance: int, with_cache: bool = False,
                   rows: str = "exact"):
    fam = family_of(model)
    eager = run(StepEngine(fam), traffic(model, "eager"))
    compiled = CompiledBlocks(fam.denoisers, "cpu", backend=backend, rows=rows)
    seen = []  # the rows each compiled call ran
    for cls, fn in dict(compiled._compiled).items():
        compiled._compiled[cls] = lambda block, *a, fn=fn, **kw: (
            seen.append(next(t for t in (*a, *kw.values()) if hasattr(t, "shape")).shape[0]),
            fn(block, *a, **kw))[1]
    cache = StepCache(fam.denoisers) if with_cache else None
    try:
        engine = StepEngine(fam, step_cache=cache)
        first = run(engine, traffic(model, "first"))
        assert compiled.take_new() > 0
        again = run(engine, traffic(model, "again"))  # the same shapes and buckets once more
        assert compiled.take_new() == 0  # no recompilation in steady state
    finally:
        if cache is not None:
            cache.close()
        compiled.close()
    powers = {r for r in seen if r & (r - 1) == 0}
    # Exact rows run as themselves (3 rows as 3, not a bucket of 4); buckets only as powers of 2.
    assert (seen and powers != set(seen)) if rows == "exact" else powers == set(seen), seen
    for rid, image in eager.items():
        assert max_diff(first[rid], image) <= tolerance, (model, rid)
        assert max_diff(again[rid], image) <= tolerance, (model, rid)


# The UNet's graph capture takes ~17 s on a 2-core machine: the default suite runs the MM-DiT's.
@pytest.mark.parametrize("model", [pytest.param("tiny-sd", marks=pytest.mark.slow), "tiny-flux"])
@pytest.mark.parametrize("rows", ["exact", pytest.param("buckets", marks=pytest.mark.slow)])
def test_compiled_blocks_equal_eager_and_do_not_recompile(model, rows):
    check_compiled(model, "eager", 2, with_cache=model == "tiny-flux", rows=rows)


def test_padding_rows_are_discarded():
    fam = family_of("tiny-flux")
    transformer = fam.denoiser
    x = torch.randn(3, 16, 16)
    kwargs = dict(encoder_hidden_states=torch.randn(3, 8, 32), pooled_projections=torch.randn(3, 32),
                  timestep=torch.full((3,), 0.5), guidance=None,
                  txt_ids=torch.zeros(8, 3), img_ids=torch.zeros(16, 3), return_dict=False)
    with torch.inference_mode():
        expected = transformer(x, **kwargs)[0]
        compiled = CompiledBlocks([transformer], "cpu", backend="eager", rows="buckets")
        try:
            got = transformer(x, **kwargs)[0]  # 3 rows run as a bucket of 4
        finally:
            compiled.close()
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # batch size's rounding only


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-sd", "tiny-flux"])
def test_inductor_buckets_are_within_two_levels_of_eager(model):
    check_compiled(model, "inductor", 2, with_cache=True)


def test_prompts_of_other_lengths_share_a_text_bucket_with_static_shapes():
    """Qwen-Image keeps each prompt's own token length; with --compile-rows buckets every length
    would be a graph of its own, so lengths are padded (masked) to a multiple of 64 tokens: a
    longer prompt in the same bucket compiles nothing new, and its image is the eager one."""
    model = "tiny-qwen-image"
    fam = family_of(model)
    short, long = "a cat", "a small red cat asleep on a wooden chair by the window in the evening"
    assert fam.text_bucket == 64
    one = lambda prompt, tag: {0: [make_request(request_id=f"{tag}-{prompt}", model=model,  # noqa: E731
                                                prompt=prompt, seed=4, steps=2)]}
    eager = {p: run(StepEngine(fam), one(p, "eager"))[p] for p in (short, long)}
    compiled = CompiledBlocks(fam.denoisers, "cpu", backend="eager", rows="buckets")
    try:
        engine = StepEngine(fam, text_multiple=compiled.text_multiple(fam))
        first = run(engine, one(short, "first"))
        assert compiled.take_new() > 0
        second = run(engine, one(long, "second"))
        assert compiled.take_new() == 0  # the longer prompt ran in the shorter one's graph
        unpadded = run(StepEngine(fam), one(long, "unpadded"))
        assert compiled.take_new() > 0  # without the bucket its own length is a new graph
    finally:
        compiled.close()
    assert max_diff(first[short], eager[short]) <= 2
    assert max_diff(second[long], eager[long]) <= 2
    assert max_diff(unpadded[long], eager[long]) <= 2


def test_the_memory_budget_holds_the_cuda_graphs_pools():
    from types import SimpleNamespace

    from diffserve.config.flags import ServerConfig
    from diffserve.executor.memory.budget import measure
    from diffserve.executor.runtime import build_runtime

    rt = build_runtime(ServerConfig(model="tiny-sd", skip_startup_check=True), torch_threads=1)
    plain = measure(rt)
    rt.compiled = SimpleNamespace(graph_bytes=3 << 20)  # as a warm-up on CUDA measured them
    assert measure(rt).held == plain.held + (3 << 20)


@pytest.mark.parametrize("graphs", [False, True])
def test_the_warm_up_runs_each_bucket_enough_forwards(graphs):
    """Three images a forward at most: buckets of 2, 4 and 6 rows (guidance's two an image)."""
    from collections import Counter

    from diffserve.config.flags import ServerConfig
    from diffserve.wire.costs import uses_cfg
    from diffserve.executor.accel.compiled import warm_up
    from diffserve.executor.runtime import build_runtime

    rt = build_runtime(ServerConfig(model="tiny-sd", skip_startup_check=True, max_batch_cost=6),
                       torch_threads=1)
    rt.compiled = CompiledBlocks(rt.family.denoisers, "cpu", backend="eager", rows="buckets")
    rt.compiled.copy = graphs  # CUDA graphs' forward count (their copies out work anywhere)
    forwards = Counter()
    hook = rt.family.denoiser.register_forward_pre_hook(
        lambda module, args: forwards.update([bucket(args[0].shape[0])]))
    try:
        warm_up(rt, rt.step_engine())
    finally:
        hook.remove()
        rt.compiled.close()
    info = rt.info
    per_image = 2 if uses_cfg(info.guidance_rule, info.default_guidance_scale, "") else 1
    expected = [bucket(per_image * n) for n in
                warm_up_images(per_image, int(info.max_batch_cost), "buckets")]
    assert expected == [2, 4, 6]
    assert forwards == dict.fromkeys(expected, 3 if graphs else 1)
