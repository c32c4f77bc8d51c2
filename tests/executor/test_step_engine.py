"""The step engine on every family it knows, in process: requests that join at different steps,
with different steps, guidance scales, negative prompts and tasks, each equal to the plain
diffusers pipeline called alone with the same inputs (within 2/255); and every stage of a step
failing only the request that causes an error."""

from __future__ import annotations

import diffusers
import pytest
import torch

from diffserve.executor.families.known import family_for
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.model.loading import load_model
from diffserve.executor.results import partial_steps
from diffserve.executor.step.engine import StepEngine
from diffserve.wire.request import WorkItem
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, sample_image, solo

FAMILIES = ["tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux"]


def engine_for(model: str, scheduler: str | None = None, **config):
    loaded = load_model(model, torch_threads=1)
    if scheduler:
        cls = getattr(diffusers, scheduler)
        loaded.pipe.scheduler = cls.from_config(loaded.pipe.scheduler.config, **config)
    pipelines = task_pipelines(loaded.pipe)
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    return loaded, pipelines, StepEngine(family)


def run(engine: StepEngine, plan: dict[int, list[tuple]], limit: int = 200):
    """Admit ``plan[step]`` (request, input frames) before that step; run until the set is empty.
    Returns {request_id: images} and the order in which requests finished."""
    images, order, step = {}, [], 0
    while step == 0 or engine:
        assert step < limit
        if step in plan:
            failed = engine.admit([WorkItem(r, 0, r.n) for r, _ in plan[step]],
                                  [frames for _, frames in plan[step]])
            assert not failed, [f.error for f in failed]
        for outcome in engine.step().finished:
            assert outcome.error is None, outcome.error
            images[outcome.item.request.request_id] = outcome.images
            order.append(outcome.item.request.request_id)
        step += 1
    return images, order


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    torch.manual_seed(0)
    return request.param, *engine_for(request.param)


def test_staggered_mixed_requests_equal_their_solo_pipeline_runs(family):
    model, loaded, edits, engine = family
    size = 64
    image, mask = sample_image(size)
    req = lambda rid, **kw: make_request(request_id=rid, model=model, width=size, height=size, **kw)
    plan = {
        0: [(req("a", prompt="a red circle", seed=1, steps=8, guidance=5.0), [])],
        2: [(req("b", prompt="a blue square", seed=2, steps=5, guidance=3.0,
                 negative_prompt="blurry", n=2), []),
            (req("edit", task="image-to-image", prompt="make it green", seed=3, steps=8,
                 guidance=4.0, strength=0.6), [image])],
        4: [(req("c", prompt="no guidance", seed=4, steps=3, guidance=1.0), []),
            (req("inpaint", task="inpaint", prompt="fill", seed=5, steps=6, guidance=6.0,
                 strength=1.0, negative_prompt="dark"), [image, mask])],
    }
    images, _ = run(engine, plan)
    for group in plan.values():
        for r, frames in group:
            expected = solo(loaded, edits, r, *frames)
            assert max_diff(images[r.request_id], expected) <= 2, (model, r.request_id)


@pytest.mark.parametrize("scheduler, config", [
    ("PNDMScheduler", {}),
    ("EulerDiscreteScheduler", {}),
    ("EulerAncestralDiscreteScheduler", {}),
    ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}),
    ("DDIMScheduler", {}),
    ("UniPCMultistepScheduler", {}),
])
def test_every_scheduler_of_the_sd_family(scheduler, config):
    loaded, edits, engine = engine_for("tiny-sd", scheduler, **config)
    plan = {0: [(make_request(request_id="x", seed=7, steps=6, guidance=5.0), [])],
            2: [(make_request(request_id="y", seed=8, steps=4, guidance=2.0,
                              negative_prompt="ugly", n=2), [])]}
    images, _ = run(engine, plan)
    for group in plan.values():
        for r, _ in group:
            assert max_diff(images[r.request_id], solo(loaded, edits, r)) <= 2, r.request_id


def test_a_short_request_that_joins_late_finishes_first(family):
    model, loaded, edits, engine = family
    plan = {0: [(make_request(request_id="long", model=model, steps=20), [])],
            3: [(make_request(request_id="short", model=model, steps=2), [])]}
    _, order = run(engine, plan)
    assert order == ["short", "long"]


def test_a_cancelled_request_leaves_at_the_next_step_and_the_rest_are_unchanged():
    loaded, edits, engine = engine_for("tiny-sd")
    stay = make_request(request_id="stay", seed=1, steps=6)
    go = make_request(request_id="go", seed=2, steps=30, n=2)
    engine.admit([WorkItem(stay, 0, 1), WorkItem(go, 0, 2)], [[], []])
    engine.step()
    engine.cancel(["go", "not-here"])
    out = engine.step()
    assert [(o.item.request.request_id, o.status) for o in out.finished] == [("go", "cancelled")]
    assert engine.samples == 1 and out.samples == 1  # that step's forward carried only "stay"
    images, _ = run(engine, {})
    assert max_diff(images["stay"], solo(loaded, edits, stay)) <= 2


def test_previews_are_intermediate_decodes_at_evenly_spaced_steps():
    assert partial_steps(3, 20) == {5: 0, 10: 1, 15: 2}
    assert partial_steps(1, 4) == {2: 0}
    assert partial_steps(3, 2) == {1: 0}  # too few steps for three distinct previews
    assert partial_steps(0, 20) == {}
    _, _, engine = engine_for("tiny-sd")
    r = make_request(request_id="p", steps=8, partial_images=3, n=2)
    engine.admit([WorkItem(r, 0, 2)], [[]])
    previews, final = [], None
    while engine:
        out = engine.step()
        previews += out.partials
        final = out.finished or final
    assert [(p.index, p.partial_index) for p in previews] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert all(p.image.shape == (64, 64, 3) for p in previews)
    assert max_diff(previews[-2].image, final[0].images[0]) > 0  # a preview, not the final image


def test_a_request_that_cannot_be_admitted_fails_alone():
    loaded, edits, engine = engine_for("tiny-sd")
    good = make_request(request_id="good", seed=3)
    broken = make_request(request_id="broken", task="image-to-image", strength=0.5)
    failed = engine.admit([WorkItem(good, 0, 1), WorkItem(broken, 0, 1)],
                          [[], [b"not an image of 64x64 pixels"]])
    assert [f.item.request.request_id for f in failed] == ["broken"]
    images, _ = run(engine, {})
    assert max_diff(images["good"], solo(loaded, edits, good)) <= 2


def test_a_request_whose_forward_fails_is_isolated_and_the_others_go_on():
    loaded, edits, engine = engine_for("tiny-sd")
    good = make_request(request_id="good", seed=3, steps=3)
    bad = make_request(request_id="bad", prompt="poison", steps=3)
    engine.admit([WorkItem(good, 0, 1), WorkItem(bad, 0, 1)], [[], []])
    (poisoned,) = [u for u in engine.units if u.item.request.request_id == "bad"]
    marker = poisoned.prepared.positive.prompt_embeds[0]
    forward = engine.family.forward

    def failing_forward(latents, timesteps, cond, guidance, width, height):
        # Any forward that carries the poisoned request's rows raises, as a kernel error would.
        if any(torch.equal(row, marker) for row in cond.prompt_embeds):
            raise RuntimeError("this request breaks the denoiser")
        return forward(latents, timesteps, cond, guidance, width, height)

    engine.family.forward = failing_forward
    out = engine.step()
    assert [(o.item.request.request_id, "breaks the denoiser" in o.error) for o in out.finished] == [
        ("bad", True)]
    engine.family.forward = forward
    images, _ = run(engine, {})
    assert max_diff(images["good"], solo(loaded, edits, good)) <= 2


def test_a_request_whose_prompt_breaks_the_encoder_fails_alone():
    """Prompts are encoded together; a request whose encoding raises (its prompt, or its adapters
    in the text encoder) fails alone and its admission-mates run exact."""
    loaded, pipelines, engine = engine_for("tiny-sd")
    encode, calls = engine.family.encode, []

    def fragile(prompts, negatives, cfg):
        calls.append(len(prompts))
        if "poison" in prompts:
            raise RuntimeError("this prompt breaks the text encoder")
        return encode(prompts, negatives, cfg)

    engine.family.encode = fragile
    good = [make_request(request_id=f"g{i}", seed=i, steps=3) for i in range(3)]
    bad = make_request(request_id="bad", prompt="poison", steps=3)
    failed = engine.admit([WorkItem(r, 0, 1) for r in [good[0], bad, *good[1:]]], [[]] * 4)
    engine.family.encode = encode
    assert [(f.item.request.request_id, "breaks the text encoder" in f.error) for f in failed] == [
        ("bad", True)]
    assert calls[0] == 4  # one call for the whole admission first
    images, _ = run(engine, {})
    for r in good:
        assert max_diff(images[r.request_id], solo(loaded, pipelines, r)) <= 2


class Fault:
    """A test hook on a family method: raises whenever a call concerns the culprit request, as a
    kernel or scheduler error would. ``concerns(culprit_unit, args)`` tells."""

    def __init__(self, engine: StepEngine, method: str, culprit: str, concerns) -> None:
        self.engine, self.method, self.concerns = engine, method, concerns
        # The culprit's unit, found while it runs (a finished one is decoded after it left).
        self.unit = next(u for u in engine.units if u.request.request_id == culprit)
        self.real = getattr(engine.family, method)
        self.raised = 0
        setattr(engine.family, method, self)

    def __call__(self, *args, **kwargs):
        if self.concerns(self.unit, args):
            self.raised += 1
            raise RuntimeError(f"injected fault in {self.method}")
        return self.real(*args, **kwargs)

    def remove(self) -> None:
        setattr(self.engine.family, self.method, self.real)


def _carries_latents(unit, args) -> bool:
    """A decode whose latents include the unit's rows."""
    latents = unit.prepared.latents
    return any(torch.equal(row, latents[0]) for row in args[0])


CONCERNS = {
    "denoise_step": lambda unit, args: args[0] is unit.scheduler,
    "blend": lambda unit, args: args[1] is unit.prepared.blend,
    "decode": _carries_latents,
}


@pytest.mark.parametrize("stage, method", [
    ("the scheduler step", "denoise_step"),
    ("the inpainting blend", "blend"),
    ("a preview decode", "decode"),
    ("the retirement decode", "decode"),
])
def test_a_fault_in_any_per_request_stage_fails_only_that_request(stage, method):
    """Each per-request stage of a step, faulted for one request in a running set of several:
    only that request fails (500 at the server), the step itself never raises, and the others'
    images equal their solo pipeline runs."""
    loaded, pipelines, engine = engine_for("tiny-sd")
    image, mask = sample_image(64)
    culprit_task = "inpaint" if method == "blend" else "generate"
    culprit = make_request(request_id="culprit", task=culprit_task, seed=9, steps=4, strength=1.0,
                           partial_images=1 if stage == "a preview decode" else 0)
    others = [make_request(request_id="a", seed=1, steps=4, partial_images=1),
              make_request(request_id="b", seed=2, steps=6, negative_prompt="dark", n=2),
              make_request(request_id="c", task="inpaint", seed=3, steps=4, strength=0.75)]
    frames = {"culprit": [image, mask] if culprit_task == "inpaint" else [], "c": [image, mask]}
    requests = [culprit, *others]
    assert not engine.admit([WorkItem(r, 0, r.n) for r in requests],
                            [frames.get(r.request_id, []) for r in requests])
    # A preview fault fires at the preview step (2 of 4); a retirement fault at the end.
    fault_from = {"a preview decode": 1, "the retirement decode": 3}.get(stage, 0)
    results, fault = {}, None
    for step in range(10):
        if step == fault_from:
            fault = Fault(engine, method, "culprit", CONCERNS[method])
        out = engine.step()  # never raises
        results.update({o.item.request.request_id: o for o in out.finished})
        if not engine:
            break
    fault.remove()
    assert fault.raised >= 1, f"the fault in {stage} never fired"
    assert results["culprit"].status == "failed" and "injected fault" in results["culprit"].error
    for r in others:
        outcome = results[r.request_id]
        assert outcome.status == "finished", (stage, r.request_id, outcome.error)
        assert max_diff(outcome.images, solo(loaded, pipelines, r, *frames.get(r.request_id, []))) <= 2


def test_flux_keeps_position_ids_for_a_bounded_number_of_sizes():
    from diffserve.executor.families.base import KEPT

    _, _, engine = engine_for("tiny-flux")
    family = engine.family
    first = family._latent_ids(64, 64)
    for side in range(16, 16 * 40, 16):  # sizes are the clients' choice
        family._latent_ids(side, 32)
    assert len(family._kept_values) == KEPT
    assert torch.equal(family._latent_ids(64, 64), first)  # evicted ids are made again, the same


def test_two_sizes_run_at_once_in_sets_of_their_own_and_are_exact():
    loaded, pipelines, engine = engine_for("tiny-sd")
    small = [make_request(request_id=f"s{i}", seed=i, steps=6, width=64, height=64)
             for i in range(3)]
    wide = [make_request(request_id=f"w{i}", seed=10 + i, steps=5, width=96, height=64,
                         negative_prompt="dark" if i else "") for i in range(2)]
    engine.admit([WorkItem(r, 0, 1) for r in small[:2]], [[], []])
    out = engine.step()
    engine.admit([WorkItem(r, 0, 1) for r in [*wide, small[2]]], [[]] * 3)
    seen = {out.batch_key}
    images, forwards = {}, []
    while engine:
        out = engine.step()
        seen.add(out.batch_key)
        forwards.append((out.size, out.samples, out.sets))
        images.update({o.item.request.request_id: o.images for o in out.finished})
    assert forwards[0][0] == "96x64"  # the new size started at the very next step
    assert forwards[0][2] == 2 and len(seen) == 2  # two running sets at once, taking turns
    assert max(samples for _, samples, _ in forwards) == 3  # the late small one joined its set
    for r in small + wide:
        assert max_diff(images[r.request_id], solo(loaded, pipelines, r)) <= 2, r.request_id


def test_an_out_of_memory_forward_splits_the_set_and_every_request_is_answered():
    """A forward of more than two rows runs out of memory (a test hook in the family's
    forward): the set is split until its parts fit, all are exact; a request that fails even
    alone is the only one to fail."""
    loaded, pipelines, engine = engine_for("tiny-sd")
    forward = engine.family.forward
    calls = []

    def limited(latents, timesteps, cond, guidance, width, height):
        calls.append(latents.shape[0])
        if latents.shape[0] > 2 or bool((guidance == 7.5).any()):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return forward(latents, timesteps, cond, guidance, width, height)

    engine.family.forward = limited
    try:
        fits = [make_request(request_id=f"f{i}", seed=i, steps=3, guidance=1.0) for i in range(4)]
        never = make_request(request_id="never", seed=9, steps=3, guidance=7.5)  # fails alone too
        engine.admit([WorkItem(r, 0, 1) for r in [*fits, never]], [[]] * 5)
        results = {}
        while engine:
            results.update({o.item.request.request_id: o for o in engine.step().finished})
    finally:
        engine.family.forward = forward
    assert results["never"].status == "failed" and "out of memory" in results["never"].error
    for r in fits:
        assert results[r.request_id].status == "finished"
        assert max_diff(results[r.request_id].images, solo(loaded, pipelines, r)) <= 2
    assert calls[0] == 6 and max(calls[1:]) <= 6  # the first try held the whole set


def test_the_retry_after_out_of_memory_holds_nothing_of_the_failed_attempt():
    """The first forward allocates (as a real one's activations would) and runs out of memory
    (torch.OutOfMemoryError; then a cuBLAS allocation failure raised as RuntimeError): by the
    time the halves run, nothing of the failed attempt is alive (a weak reference to its tensor
    is dead), and the memory was released (the cache emptied) before the retry."""
    import weakref

    from diffserve.executor.memory import oom as memory

    loaded, pipelines, engine = engine_for("tiny-sd")
    forward = engine.family.forward
    held, seen_at_retry, released = [], [], []
    errors = [torch.OutOfMemoryError("CUDA out of memory (injected)"),
              RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")]

    def first_fails(latents, *args):
        if held:  # a retry: is the failed attempt's tensor gone?
            seen_at_retry.append(held[-1]() is None)
        if errors and latents.shape[0] > 2:
            activations = torch.empty(latents.shape[0], 1 << 16)
            held.append(weakref.ref(activations))
            raise errors.pop(0)
        return forward(latents, *args)

    release = memory.release
    engine.family.forward = first_fails
    memory.release = lambda error: released.append(memory.is_out_of_memory(error)) or release(error)
    try:
        requests = [make_request(request_id=f"r{i}", seed=i, steps=3, guidance=1.0)
                    for i in range(4)]
        engine.admit([WorkItem(r, 0, 1) for r in requests], [[]] * 4)
        results = {}
        while engine:
            results.update({o.item.request.request_id: o for o in engine.step().finished})
    finally:
        engine.family.forward = forward
        memory.release = release
    assert all(o.status == "finished" for o in results.values()) and len(results) == 4
    assert len(held) == 2 and seen_at_retry and all(seen_at_retry)
    assert released == [True, True]
