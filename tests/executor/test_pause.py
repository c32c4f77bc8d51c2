"""Pausing at step boundaries, in the step engine: a paused item leaves the running set with its
latents, scheduler state and generators, and resumed later it continues exactly (the same image
as if never paused, a multistep sampler's past outputs included); a cancel reaches it while it
is paused; a resume that comes before its pause took effect leaves it running."""

from __future__ import annotations

import dataclasses

import pytest

from diffserve.config.flags import ServerConfig
from diffserve.executor.runtime import build_runtime
from diffserve.wire.protocol import CANCELLED
from diffserve.wire.request import WorkItem
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, solo


@pytest.fixture(scope="module")
def runtime():
    return build_runtime(ServerConfig(model="tiny-sd", batching_mode="step"), torch_threads=1)


def resume(item: WorkItem) -> WorkItem:
    return dataclasses.replace(item, resume=True)


@pytest.mark.parametrize("sampler", ["", "dpm++2m"])
def test_a_paused_item_resumes_and_continues_exactly(runtime, sampler):
    engine = runtime.step_engine()
    keep = WorkItem(make_request(request_id="keep", seed=1, steps=6, scheduler=sampler), 0, 1)
    paused = WorkItem(make_request(request_id="paused", seed=2, steps=6, guidance=3.0,
                                   negative_prompt="grey", scheduler=sampler, n=2), 0, 2)
    assert not engine.admit([keep, paused], [[], []])
    outputs = [engine.step() for _ in range(2)]
    engine.pause([paused.key])
    outputs += [engine.step() for _ in range(3)]
    assert [o.samples for o in outputs] == [3, 3, 1, 1, 1]  # it did not advance while paused
    assert list(engine.paused) == [paused.key] and engine
    engine.admit([resume(paused)], [[]])
    while engine:
        outputs.append(engine.step())
    images = {o.item.request.request_id: o.images for out in outputs for o in out.finished}
    again = runtime.step_engine()  # the same requests, never paused
    again.admit([keep, paused], [[], []])
    unpaused = {}
    while again:
        unpaused.update({o.item.request.request_id: o.images for o in again.step().finished})
    for item in (keep, paused):
        rid = item.request.request_id
        assert max_diff(images[rid], unpaused[rid]) <= 2
        if not sampler:  # and the plain pipeline alone
            assert max_diff(images[rid], solo(runtime.loaded, {}, item.request)) <= 2


def test_a_cancel_reaches_a_paused_item_and_a_late_resume_is_dropped(runtime):
    engine = runtime.step_engine()
    item = WorkItem(make_request(request_id="x", seed=1, steps=6), 0, 1)
    engine.admit([item], [[]])
    engine.step()
    engine.pause([item.key])
    engine.step()
    assert not engine and list(engine.paused) == [item.key]  # nothing to step: it waits
    engine.cancel(["x"])
    (o,) = engine.step().finished
    assert o.status == CANCELLED and not engine.paused
    engine.admit([resume(item)], [[]])  # its resume, sent before the cancel was known
    assert not engine and not engine.units


def test_a_resume_before_the_pause_took_effect_keeps_it_running(runtime):
    engine = runtime.step_engine()
    item = WorkItem(make_request(request_id="x", seed=1, steps=3), 0, 1)
    engine.admit([item], [[]])
    engine.pause([item.key])
    engine.admit([resume(item)], [[]])
    outcomes = []
    while engine:
        outcomes += engine.step().finished
    assert [o.item.request.request_id for o in outcomes] == ["x"] and not engine.paused
