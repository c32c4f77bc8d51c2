"""A sampler per request: every sampler a model offers, picked by requests that share one running
set (and in request mode, one call per sampler), equals the plain pipeline with that scheduler
set; a model offers only what its scheduler is compatible with."""

from __future__ import annotations

import diffusers
import pytest

from diffserve.config.flags import ServerConfig
from diffserve.executor.runtime import build_runtime
from diffserve.executor.model.samplers import SAMPLERS, offered
from diffserve.wire.request import Work, WorkItem
from helpers import make_request, run_plan
from diffserve.executor.checks.reference import max_diff, solo


@pytest.fixture(scope="module")
def runtime():
    return build_runtime(ServerConfig(model="tiny-sd", batching_mode="step"), torch_threads=1)


def expected(rt, request):
    """The plain pipeline with the request's sampler set, as diffusers' docs set one."""
    pipe, original = rt.loaded.pipe, rt.loaded.pipe.scheduler
    cls, options = SAMPLERS[request.scheduler]
    pipe.scheduler = getattr(diffusers, cls).from_config(original.config, **options)
    try:
        return solo(rt.loaded, {}, request)
    finally:
        pipe.scheduler = original


def test_what_a_model_offers_follows_its_scheduler(runtime):
    assert runtime.info.schedulers == offered(runtime.loaded.pipe.scheduler)
    assert {"ddim", "euler", "dpm++2m-karras", "unipc", "heun"} <= set(runtime.info.schedulers)
    assert "flow-euler" not in runtime.info.schedulers
    assert offered(diffusers.FlowMatchEulerDiscreteScheduler()) == ["flow-euler"]


def test_requests_with_different_samplers_share_a_running_set_and_are_exact(runtime):
    requests = [make_request(request_id=name, seed=i, steps=4 + i % 3, guidance=4.0,
                             negative_prompt="grey" if i % 2 else "", scheduler=name)
                for i, name in enumerate(runtime.info.schedulers)]
    plan = {0: [(r, []) for r in requests[::2]], 2: [(r, []) for r in requests[1::2]]}
    images = run_plan(runtime.step_engine(), plan)
    for r in requests:
        assert max_diff(images[r.request_id], expected(runtime, r)) <= 2, r.scheduler


def test_request_mode_runs_a_call_with_its_sampler(runtime):
    r = make_request(request_id="k", seed=3, steps=5, n=2, scheduler="dpm++2m-karras")
    (o,) = runtime.request_runner().execute(Work(1, [WorkItem(r, 0, 2)]), [[]])
    assert o.error is None and max_diff(o.images, expected(runtime, r)) <= 2
    assert runtime.loaded.pipe.scheduler is not None
    assert type(runtime.loaded.pipe.scheduler).__name__ == "DDIMScheduler"  # put back after


def test_a_model_lists_only_the_samplers_that_run_on_it():
    """Sana's scheduler is DPM-Solver++ over flow-matching sigmas: diffusers calls DDIM or Euler
    compatible, but they cannot take a flow-prediction config, so the model does not offer them."""
    rt = build_runtime(ServerConfig(model="tiny-sana", batching_mode="step"), torch_threads=1)
    assert "dpm++2m" in rt.info.schedulers and "unipc" in rt.info.schedulers
    assert not {"ddim", "euler", "pndm"} & set(rt.info.schedulers)
    assert set(rt.info.schedulers) < set(offered(rt.loaded.pipe.scheduler))
