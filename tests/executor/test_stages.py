"""The encode and decode stages beside the step loop (--stages on), in process: a stage runs its
jobs in order on a thread of its own and hands back results and errors; an engine with stages
makes every image equal to the plain pipeline's, keeps stepping while a newcomer's prompt is
encoded, fails only the request whose encode or decode raises, answers a request cancelled
while its job runs, and encodes a repeated prompt once (the prompt cache)."""

from __future__ import annotations

import select
import threading
import time

import pytest
import torch

from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.step.prompt_cache import PromptCache
from diffserve.executor.step.stages import StageJob, Stage
from diffserve.executor.step.engine import StepEngine
from diffserve.wire.request import WorkItem
from helpers import make_request
from pace import scaled
from diffserve.executor.checks.reference import max_diff, sample_image, solo

WAIT_S = 60  # a bound for one stage job on the reference machine, never a pace


# -- the stage alone --------------------------------------------------------------------


def _stage(threaded: bool = True, bound: int = 64):
    done = threading.Event()
    return Stage("test", torch, "cpu", threaded, done.set, bound), done


def _take_all(stage: Stage, done: threading.Event, count: int) -> list[StageJob]:
    """Jobs taken back until ``count`` are, each wait for the stage's notice bounded."""
    taken = []
    while True:
        done.clear()
        taken += stage.take()
        if len(taken) >= count:
            return taken
        assert done.wait(scaled(WAIT_S)), "the stage finished no job in time"


def test_a_stage_runs_its_jobs_in_order_on_its_own_thread_and_hands_back_errors():
    stage, notified = _stage()
    threads, order = [], []

    def job(i):
        def run():
            threads.append(threading.current_thread().name)
            order.append(i)
            if i == 2:
                raise ValueError("job 2 breaks")
            return i * 10
        return StageJob({f"r{i}"}, run)

    for i in range(4):
        stage.submit(job(i))
    taken = _take_all(stage, notified, 4)
    stage.close()
    assert order == [0, 1, 2, 3] and [j.request_ids for j in taken] == [{"r0"}, {"r1"}, {"r2"}, {"r3"}]
    assert set(threads) == {"stage-test"}  # never the caller's thread
    assert [j.result for j in taken] == [0, 10, None, 30]
    assert isinstance(taken[2].error, ValueError) and taken[1].error is None
    busy, stall = stage.take_times()
    assert busy > 0 and stall == 0  # nothing ran on the caller's thread
    assert stage.depth == 0


def test_a_job_cancelled_before_it_starts_never_runs():
    stage, done = _stage()
    release, ran = threading.Event(), []
    stage.submit(StageJob({"a"}, lambda: release.wait(scaled(WAIT_S))))
    stage.submit(StageJob({"b"}, lambda: ran.append("b")))
    stage.submit(StageJob({"c", "d"}, lambda: ran.append("c")))
    stage.cancel({"b", "c"})  # "c"'s job is also "d"'s: it still runs
    release.set()
    taken = _take_all(stage, done, 3)
    stage.close()
    assert ran == ["c"]
    assert [j.cancelled for j in taken] == [False, True, False]


def test_an_inline_stage_runs_the_job_on_the_caller_and_counts_it_as_stall():
    inline, _ = _stage(threaded=False)
    inline.submit(StageJob({"a"}, lambda: threading.current_thread().name))
    assert [j.result for j in inline.take()] == [threading.current_thread().name]
    assert inline.take_times()[1] > 0


def test_a_full_stage_makes_the_caller_wait_for_room_and_keeps_the_order():
    full, done = _stage(bound=1)
    release = threading.Event()
    full.submit(StageJob({"a"}, lambda: release.wait(scaled(WAIT_S)) and "a"))

    def open_once_the_caller_waits():  # the stage's condition has no event for "a waiter"
        deadline = time.monotonic() + scaled(WAIT_S)
        while not full._lock._waiters and time.monotonic() < deadline:
            time.sleep(0.001)
        release.set()

    threading.Thread(target=open_once_the_caller_waits, daemon=True).start()
    full.submit(StageJob({"b"}, lambda: "b"))  # waits until "a" is done
    taken = _take_all(full, done, 2)
    full.close()
    assert [j.result for j in taken] == ["a", "b"]
    assert full.take_times()[1] > 0  # the caller's wait is the stage's stall


def test_a_job_in_parts_lets_the_jobs_behind_it_run_between_its_parts():
    stage, done = _stage()
    ran, release = [], threading.Event()

    def long_job():
        for part in range(3):
            ran.append(f"long {part}")
            if part == 0:
                assert release.wait(scaled(WAIT_S))
            yield
        return "long"

    stage.submit(StageJob({"long"}, long_job))
    stage.submit(StageJob({"short"}, lambda: ran.append("short") or "short"))
    release.set()
    taken = _take_all(stage, done, 2)
    stage.close()
    assert [j.result for j in taken] == ["short", "long"]
    assert ran == ["long 0", "short", "long 1", "long 2"]

    inline, _ = _stage(threaded=False)  # inline, a job in parts runs to its end at once
    inline.submit(StageJob({"long"}, lambda: (yield) or "all"))
    assert [j.result for j in inline.take()] == ["all"]


def test_the_prompt_cache_keys_on_everything_an_encoding_depends_on():
    cache = PromptCache(1 << 20)
    r = make_request(prompt="a cat", negative_prompt="blurry")
    base = cache.key(r, True, True, (), None)
    assert cache.key(make_request(prompt="a cat", negative_prompt="blurry", seed=9), True, True,
                     (), None) == base  # the seed does not touch the encoding
    others = [cache.key(make_request(prompt="a dog", negative_prompt="blurry"), True, True, (), None),
              cache.key(r, True, False, (), None),  # the negative prompt not used
              cache.key(r, False, False, (), None),
              cache.key(r, True, True, (("style@1", 1.0),), None),
              cache.key(r, True, True, (("style@2", 1.0),), None),  # the adapter replaced
              cache.key(r, True, True, (), [sample_image(16)[0]])]
    assert len({base, *others}) == len(others) + 1
    # A weight update replaces the denoiser's weights only: the encoder's encodings still hold.
    assert not hasattr(cache, "version")


# -- an engine with stages --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_flux():
    loaded = load_model("tiny-flux", torch_threads=1)
    pipelines = task_pipelines(loaded.pipe)
    return loaded, pipelines


def staged_engine(loaded, pipelines, **kwargs) -> StepEngine:
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    return StepEngine(family, stages=True, **kwargs)


def step_until_done(engine: StepEngine, limit: int = 400, outs: list | None = None) -> dict:
    """Step (waiting on the engine's wakeup when only stage work is left) until it holds
    nothing; returns each request's outcome (and appends each step's output to ``outs``)."""
    outcomes = {}
    for _ in range(limit):
        if not engine:
            return outcomes
        if not engine.steppable:
            ready, _, _ = select.select([engine.wakeup.read_fd], [], [], scaled(WAIT_S))
            assert ready, "no stage finished a job in time"
            engine.wakeup.clear()
        out = engine.step()
        outcomes.update({o.item.request.request_id: o for o in out.finished})
        if outs is not None:
            outs.append(out)
    raise AssertionError("the engine never emptied")


class Gate:
    """A family method that waits for ``open`` before it runs (for the requests ``concerns``
    picks), so that a test knows a stage job is in flight; or raises for them."""

    def __init__(self, family, method: str, concerns, raises: bool = False) -> None:
        self.family, self.method, self.concerns, self.raises = family, method, concerns, raises
        self.real = getattr(family, method)
        self.entered, self.open = threading.Event(), threading.Event()
        setattr(family, method, self)

    def __call__(self, *args, **kwargs):
        if self.concerns(args):
            if self.raises:
                raise RuntimeError(f"injected fault in {self.method}")
            self.entered.set()
            assert self.open.wait(scaled(WAIT_S)), "the gate was never opened"
        return self.real(*args, **kwargs)

    def remove(self) -> None:
        setattr(self.family, self.method, self.real)


def test_with_stages_every_image_equals_the_plain_pipeline_and_steps_go_on_during_an_encode(tiny_flux):
    loaded, pipelines = tiny_flux
    engine = staged_engine(loaded, pipelines)
    image, _ = sample_image(64)
    first = make_request(request_id="first", model="tiny-flux", prompt="a red circle", seed=1,
                         steps=8, guidance=3.5)
    late = [make_request(request_id="late", model="tiny-flux", prompt="a blue square", seed=2,
                         steps=5, guidance=2.0, n=2),
            make_request(request_id="edit", model="tiny-flux", task="image-to-image",
                         prompt="make it green", seed=3, steps=8, strength=0.6)]
    engine.admit([WorkItem(first, 0, 1)], [[]])
    outcomes = {}
    # the first request's admission comes back, then it steps
    while not engine.units:
        outcomes.update(step_until_ready(engine))
    gate = Gate(engine.family, "encode", lambda args: "a blue square" in args[0])
    try:
        assert engine.admit([WorkItem(r, 0, r.n) for r in late], [[], [image]]) == []
        assert gate.entered.wait(scaled(WAIT_S))
        before = engine.units[0].step
        for _ in range(3):  # the newcomers' encode holds: the running request steps on
            outcomes.update({o.item.request.request_id: o for o in engine.step().finished})
        assert engine.units[0].step == before + 3
        assert [u.request.request_id for u in engine.units] == ["first"]
    finally:
        gate.open.set()
        gate.remove()
    outcomes.update(step_until_done(engine))
    engine.close()
    for r, frames in [(first, []), (late[0], []), (late[1], [image])]:
        o = outcomes[r.request_id]
        assert o.status == "finished", (r.request_id, o.error)
        assert max_diff(o.images, solo(loaded, pipelines, r, *frames)) <= 2, r.request_id


STAGED_FAMILIES = {  # one model per kind of family: its requests, its input frames
    "tiny-sd": lambda image, mask: [
        ("g", dict(prompt="a red circle", seed=1, steps=4, negative_prompt="dark"), []),
        ("i2i", dict(task="image-to-image", prompt="green", seed=2, steps=5, strength=0.6), [image]),
        ("inpaint", dict(task="inpaint", prompt="fill", seed=3, steps=4), [image, mask])],
    "tiny-qwen-image": lambda image, mask: [
        ("g", dict(prompt="a red circle", seed=1, steps=4, negative_prompt="dark"), []),
        ("h", dict(prompt="a blue square, much longer", seed=2, steps=3, n=2), [])],
    "tiny-z-image": lambda image, mask: [
        ("g", dict(prompt="a red circle", seed=1, steps=4, guidance=1.0), []),
        ("h", dict(prompt="a blue square, much longer", seed=2, steps=3, guidance=1.0), [])],
}


@pytest.mark.parametrize("model", list(STAGED_FAMILIES))
def test_every_kind_of_family_stays_exact_with_threaded_stages(model):
    from helpers import run_plan

    loaded = load_model(model, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe)
    engine = staged_engine(loaded, pipelines)
    image, mask = sample_image(64)
    requests = [(make_request(request_id=rid, model=model, **fields), frames)
                for rid, fields, frames in STAGED_FAMILIES[model](image, mask)]
    plan = {0: requests[:1], 1: requests[1:]}
    images = run_plan(engine, plan)
    engine.close()
    for r, frames in requests:
        assert max_diff(images[r.request_id], solo(loaded, pipelines, r, *frames)) <= 2, r.request_id


def test_a_video_decoded_in_parts_equals_its_whole_decode(monkeypatch):
    from diffserve.executor.families.wan import step as wan

    loaded = load_model("tiny-wan", torch_threads=1)
    family = family_for(loaded.pipeline_class)(loaded.pipe, task_pipelines(loaded.pipe),
                                               loaded.call_kwargs)
    monkeypatch.setattr(wan, "LATENT_FRAMES_PER_PART", 1)
    latents = torch.randn(2, loaded.pipe.vae.config.z_dim, 5, 4, 4,
                          generator=torch.Generator().manual_seed(0))
    count = 0
    with torch.inference_mode():  # as the stage runs it
        parts = family.decode_parts(latents, 32, 32, None)
        try:
            while True:
                next(parts)
                count += 1
        except StopIteration as end:
            pieces = end.value
        whole = family.decode(latents, 32, 32, None)
    assert count == 4  # five latent frames, one a part
    assert pieces.shape == whole.shape == (2, 17, 32, 32, 3)
    assert max_diff(pieces, whole) == 0


def step_until_ready(engine: StepEngine) -> dict:
    """One wait for a stage, then one step: what finished."""
    ready, _, _ = select.select([engine.wakeup.read_fd], [], [], scaled(WAIT_S))
    assert ready, "no stage finished a job in time"
    engine.wakeup.clear()
    return {o.item.request.request_id: o for o in engine.step().finished}


@pytest.mark.parametrize("method", ["encode", "decode"])
def test_a_stage_job_that_raises_fails_only_its_own_request(tiny_flux, method):
    loaded, pipelines = tiny_flux
    engine = staged_engine(loaded, pipelines)
    requests = [make_request(request_id=rid, model="tiny-flux", prompt=f"prompt {rid}", seed=i,
                             steps=3 + i, guidance=3.5) for i, rid in enumerate(["a", "culprit", "b"])]
    if method == "encode":
        concerns = lambda args: "prompt culprit" in args[0]  # noqa: E731
    else:  # a decode whose latents are the culprit's (it alone finishes at its step)
        concerns = lambda args: engine_culprit_decoding(engine)  # noqa: E731
    gate = Gate(engine.family, method, concerns, raises=True)
    try:
        engine.admit([WorkItem(r, 0, 1) for r in requests], [[]] * 3)
        outcomes = step_until_done(engine)
    finally:
        gate.remove()
        engine.close()
    assert outcomes["culprit"].status == "failed"
    assert "injected fault" in outcomes["culprit"].error
    for r in (requests[0], requests[2]):
        o = outcomes[r.request_id]
        assert o.status == "finished", (r.request_id, o.error)
        assert max_diff(o.images, solo(loaded, pipelines, r)) <= 2


def engine_culprit_decoding(engine: StepEngine) -> bool:
    """Whether the decode stage's job in flight holds the culprit's unit (4 steps: alone)."""
    job = engine.stage_work.decode._running
    return job is not None and any(u.request.request_id == "culprit"
                                   for u in job.meta.get("units", []))


def test_a_request_cancelled_while_its_encode_runs_is_answered_cancelled(tiny_flux):
    loaded, pipelines = tiny_flux
    engine = staged_engine(loaded, pipelines)
    gone = make_request(request_id="gone", model="tiny-flux", prompt="cancel me", steps=4)
    kept = make_request(request_id="kept", model="tiny-flux", prompt="keep me", steps=4)
    gate = Gate(engine.family, "encode", lambda args: "cancel me" in args[0])
    try:
        engine.admit([WorkItem(gone, 0, 1)], [[]])
        engine.admit([WorkItem(kept, 0, 1)], [[]])  # queued behind it on the encode stage
        assert gate.entered.wait(scaled(WAIT_S))
        engine.cancel(["gone"])
        gate.open.set()
        outcomes = step_until_done(engine)
    finally:
        gate.remove()
        engine.close()
    assert outcomes["gone"].status == "cancelled"
    assert outcomes["kept"].status == "finished"
    assert all(u.request.request_id != "gone" for u in engine.units)


def test_a_repeated_prompt_is_encoded_once_and_its_images_are_unchanged(tiny_flux):
    loaded, pipelines = tiny_flux
    cache = PromptCache(1 << 30)
    engine = staged_engine(loaded, pipelines, prompt_cache=cache)
    encoded = []
    real = engine.family.encode
    engine.family.encode = lambda prompts, *a, **k: encoded.append(list(prompts)) or real(prompts, *a, **k)
    group = [make_request(request_id=f"g{i}", model="tiny-flux", prompt="one prompt", seed=i,
                          steps=3, guidance=3.5) for i in range(4)]
    other = make_request(request_id="other", model="tiny-flux", prompt="another", seed=9, steps=3)
    try:
        engine.admit([WorkItem(r, 0, 1) for r in [*group[:3], other]], [[]] * 4)
        outs = []
        outcomes = step_until_done(engine, outs=outs)
        engine.admit([WorkItem(group[3], 0, 1)], [[]])  # later: from the cache
        outcomes.update(step_until_done(engine, outs=outs))
    finally:
        engine.family.encode = real
        engine.close()
    assert sorted(p for call in encoded for p in call) == ["another", "one prompt"]
    counts = [out.prompt_cache for out in outs]
    assert tuple(map(sum, zip(*counts))) == (3, 2)  # g1, g2 (same call), g3 (kept); g0 and other encoded
    assert len(cache) == 2 and cache.nbytes > 0
    for r in [*group, other]:
        assert max_diff(outcomes[r.request_id].images, solo(loaded, pipelines, r)) <= 2
