"""The step engine through the real server: the batching-mode flag, early finish, a departed
caller's slot reused at once, and a crash mid-run that answers everyone."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from diffserve.executor.model.loading import load_model
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, solo
from server import (
    LAUNCHES,
    Server,
    assert_openai_error,
    decode,
    hanging_up,
    metric,
    pids_titled,
    serves,
    spec,
    wait_for_metric,
)
from pace import scaled

GENERATE = "/v1/images/generations"


def post(server: Server, body: dict, timeout: float = 120) -> httpx.Response:
    with server.client(timeout=timeout) as c:
        return c.post(GENERATE, json=body)


@pytest.fixture(scope="module")
@serves(spec("--batching-mode", "step", "--dynamic-batch-max-size", "2",
             "--max-inference-steps", "1000", "--dynamic-batch-delay-ms", "0", "--stages", "on"))
def server(request):
    with LAUNCHES.take(request) as srv:
        yield srv


def test_the_mode_is_shown(server):
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["batching_mode"] == "step"
    assert httpx.get(server.url + "/health").json()["batching_mode"] == "step"
    assert metric(httpx.get(server.url + "/metrics").text, "diffserve_batching_mode", mode="step") == 1
    assert "step mode" in server.log


def test_prompts_and_images_go_through_the_stages_and_a_repeated_prompt_is_kept(server):
    text = lambda: httpx.get(server.url + "/metrics").text  # noqa: E731
    hits = lambda t: metric(t, "diffserve_prompt_cache_requests_total", outcome="hit")  # noqa: E731
    before = text()
    first = post(server, {"prompt": "stages: once", "num_inference_steps": 3, "seed": 1})
    again = post(server, {"prompt": "stages: once", "num_inference_steps": 3, "seed": 1})
    assert first.status_code == 200 and again.status_code == 200
    assert decode(first.json()["data"][0]["b64_json"]).tobytes() == \
        decode(again.json()["data"][0]["b64_json"]).tobytes()  # the kept encoding is the same
    after = text()
    assert hits(after) - hits(before) >= 1
    for stage in ("encode", "decode"):
        busy = lambda t: metric(t, "diffserve_stage_busy_seconds_total", stage=stage)  # noqa: E731
        assert busy(after) > busy(before), stage
        assert metric(after, "diffserve_stage_queue_depth", stage=stage) == 0
        assert f'diffserve_step_stall_seconds_total{{executor="0",stage="{stage}"}}' in after
    assert "encode and decode stages on" in server.log


def test_a_short_request_that_arrives_during_a_long_one_finishes_first(server):
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(post, server, {"prompt": "long", "num_inference_steps": 300, "seed": 1})
        wait_for_metric(server, "diffserve_num_requests_running", lambda v: v >= 1)
        short = post(server, {"prompt": "short", "num_inference_steps": 2, "seed": 2})
        assert short.status_code == 200
        assert not long.done(), "the short request waited for the long one"
        assert long.result().status_code == 200


def test_a_departed_caller_frees_its_slot_and_the_others_are_unchanged(server):
    """The running set holds two; once both run, the second caller hangs up. Its slot is free
    at the next step: a newcomer is admitted and done while the first request still runs (it has
    many more steps than the newcomer and the cancel take), and the first is unchanged."""
    loaded = load_model("tiny-sd", torch_threads=1)
    stays = {"prompt": "stays", "num_inference_steps": 300, "seed": 3, "guidance_scale": 3.0}
    before = metric(httpx.get(server.url + "/metrics").text, "diffserve_step_retirements_total",
                    outcome="cancelled")
    with ThreadPoolExecutor(1) as pool:
        kept = pool.submit(post, server, stays)
        wait_for_metric(server, "diffserve_num_requests_running", lambda v: v >= 1)
        with hanging_up(server, {"prompt": "leaves", "num_inference_steps": 900, "seed": 4}):
            wait_for_metric(server, "diffserve_num_requests_running", lambda v: v >= 2)
        wait_for_metric(server, "diffserve_step_retirements_total", lambda v: v > before,
                        outcome="cancelled")
        # The running set is full without the departed caller's slot; a newcomer gets it now.
        newcomer = post(server, {"prompt": "newcomer", "num_inference_steps": 2, "seed": 5})
        assert newcomer.status_code == 200 and not kept.done()
        response = kept.result()
    expected = solo(loaded, {}, make_request(prompt="stays", seed=3, steps=300, guidance=3.0))[0]
    assert max_diff(decode(response.json()["data"][0]["b64_json"]), expected) <= 2


# Four guided 64x64 images cost 8: the running set fills the executor's cost budget.
@pytest.mark.server("--batching-mode", "step", "--dynamic-batch-max-size", "4",
                    "--max-running-cost", "8", "--max-inference-steps", "1000")
def test_an_executor_crash_mid_run_answers_every_running_request_at_once(own_server):
    """The two that stream previews are answered 503 at once (the scheduler cannot know what
    their clients saw); the one that emitted nothing runs again after the restart, as the
    queued one runs, and both are answered with their images."""
    with own_server as srv:
        (executor,) = pids_titled(srv.proc.pid, "diffserve::executor")
        streamed = {"stream": True, "partial_images": 1}
        with ThreadPoolExecutor(5) as pool:
            running = [pool.submit(post, srv, {"prompt": f"r{i}", "num_inference_steps": 600,
                                               "n": 2 if i == 0 else 1, **(streamed if i < 2 else {})})
                       for i in range(3)]
            wait_for_metric(srv, "diffserve_num_requests_running", lambda v: v >= 3)
            queued = pool.submit(post, srv, {"prompt": "queued", "num_inference_steps": 4,
                                             "size": "128x64"})  # no room left: it waits
            wait_for_metric(srv, "diffserve_num_requests_waiting", lambda v: v >= 1)
            killed_at = time.monotonic()
            os.kill(executor, signal.SIGKILL)
            answers = [f.result() for f in running[:2]]
            answered_in = time.monotonic() - killed_at
            assert queued.result().status_code == 200  # kept in the queue, run after the restart
            assert running[2].result().status_code == 200  # ran again
        for r in answers:
            assert_openai_error(r, 503, code="executor_restarted")
        assert answered_in < 2.0


@pytest.mark.server("--model", "tiny-hunyuandit", "--batching-mode", "step")
def test_step_mode_on_a_family_it_does_not_know_refuses_to_start(own_server):
    srv = own_server
    assert srv.proc.wait(scaled(120)) == 1
    assert "--batching-mode step does not support HunyuanDiTPipeline" in srv.log, srv.log
    assert "Use --batching-mode request" in srv.log


@pytest.mark.server("--batching-mode", "request")
def test_request_mode_is_kept_on_request(own_server):
    with own_server as srv:
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["batching_mode"] == "request"


@pytest.mark.server("--batching-mode", "step", "--dynamic-batch-max-size", "4",
                    "--dynamic-batch-delay-ms", "0", "--max-inference-steps", "1000")
def test_two_sizes_are_in_flight_at_once_on_one_executor_and_exact(own_server):
    loaded = load_model("tiny-sd", torch_threads=1)
    bodies = [{"prompt": f"size {size} #{i}", "size": size, "seed": 20 + i,
               "num_inference_steps": 120 if i < 2 else 6}
              for i, size in enumerate(["64x64", "96x64", "64x64", "96x64"])]
    with own_server as srv:
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(post, srv, bodies[0])
            wait_for_metric(srv, "diffserve_num_requests_running", lambda v: v >= 1)
            rest = [pool.submit(post, srv, b) for b in bodies[1:]]
            # Both sizes run on the one executor at once: two running sets.
            assert wait_for_metric(srv, "diffserve_running_sets", lambda v: v >= 2) >= 2
            responses = [first.result()] + [f.result() for f in rest]
        text = httpx.get(srv.url + "/metrics").text
    assert metric(text, "diffserve_dispatches_total", reason="new_set") >= 1
    assert metric(text, "diffserve_steps_total", size="96x64") >= 120  # each size's own steps
    assert metric(text, "diffserve_steps_total", size="64x64") >= 120
    for body, r in zip(bodies, responses):
        assert r.status_code == 200, r.text
        w, h = (int(v) for v in body["size"].split("x"))
        expected = solo(loaded, {}, make_request(prompt=body["prompt"], seed=body["seed"],
                                                 steps=body["num_inference_steps"], width=w,
                                                 height=h))[0]
        assert max_diff(decode(r.json()["data"][0]["b64_json"]), expected) <= 2, body


# tiny-sd runs guidance at 5.0 by default: a native 64x64 image costs 2 rows.
@pytest.mark.server("--batching-mode", "step", "--max-batch-cost", "4", "--max-running-cost", "8")
def test_a_request_over_the_forward_cost_bound_is_split_or_refused(own_server):
    with own_server as srv:
        split = post(srv, {"prompt": "three", "n": 3, "seed": 1})  # 2 per forward at most
        assert split.status_code == 200 and len(split.json()["data"]) == 3
        no_cfg = post(srv, {"prompt": "wide", "size": "128x64", "guidance_scale": 1.0})
        assert no_cfg.status_code == 200  # 2 rows' worth without guidance: fits
        refused = post(srv, {"prompt": "too big", "size": "128x128"})  # 4 x 2 = 8 > 4
        error = assert_openai_error(refused, 400, param="size", code="invalid_size")
        assert "--max-batch-cost" in error["message"] and "128x128" in error["message"]
        text = httpx.get(srv.url + "/metrics").text
        assert metric(text, "diffserve_forward_cost_count") >= 2
        assert metric(text, "diffserve_forward_cost_sum") / metric(text, "diffserve_forward_cost_count") <= 4
