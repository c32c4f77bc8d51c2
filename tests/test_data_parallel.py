"""One queue feeding two executors, through the real server: both run work, every image is its
own, and killing one executor fails only what it held while the other keeps answering."""

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
from pace import scaled
from server import Server, decode, metric, pids_titled, wait_for_metric

GENERATE = "/v1/images/generations"


def health_once(server: Server, ready, timeout_s: float = 120) -> httpx.Response:
    """/health as soon as ``ready(executors' states)`` holds: a death, a restart or a slower
    start is reported only there (it is 200 once one executor serves)."""
    deadline = time.monotonic() + scaled(timeout_s)
    while True:
        response = httpx.get(server.url + "/health")
        if ready([e["state"] for e in response.json()["executors"]]):
            return response
        assert time.monotonic() < deadline, response.text
        time.sleep(0.02)


def wait_all_ready(server: Server, timeout_s: float = 120) -> dict:
    return health_once(server, lambda states: all(s == "ready" for s in states), timeout_s).json()


def per_executor(text: str, name: str) -> list[float]:
    return [metric(text, name, executor=str(i)) for i in range(2)]


@pytest.mark.parametrize("mode", ["step", "request"])
@pytest.mark.server("--data-parallel-size", "2", "--torch-threads", "1", "--batching-mode", "{mode}",
                    "--dynamic-batch-max-size", "4")
def test_both_executors_serve_and_every_image_is_its_own(mode, own_server):
    loaded = load_model("tiny-sd", torch_threads=1)
    bodies = [{"prompt": f"request {i}", "seed": 500 + 13 * i} for i in range(16)]
    with own_server as srv, srv.client() as c:
        health = wait_all_ready(srv)
        assert [e["index"] for e in health["executors"]] == [0, 1]
        with ThreadPoolExecutor(len(bodies)) as pool:
            responses = list(pool.map(lambda b: c.post(GENERATE, json=b), bodies))
        text = c.get("/metrics").text
    assert [r.status_code for r in responses] == [200] * len(bodies)
    assert all(n > 0 for n in per_executor(text, "diffserve_images_generated_total")), text
    assert all(n > 0 for n in per_executor(text, "diffserve_batch_size_count"))
    for body, r in zip(bodies, responses):
        expected = solo(loaded, {}, make_request(prompt=body["prompt"], seed=body["seed"]))[0]
        assert max_diff(decode(r.json()["data"][0]["b64_json"]), expected) <= 2, body


@pytest.mark.server("--data-parallel-size", "2", "--torch-threads", "1", "--dynamic-batch-max-size",
                    "2", "--dynamic-batch-delay-ms", "0", "--max-inference-steps", "1000")
def test_killing_one_executor_runs_its_requests_again_and_it_comes_back(own_server):
    """The killed executor's requests had emitted nothing: they run again (on the survivor, or
    on the restarted executor) and are answered with their own images."""
    with own_server as srv:
        wait_all_ready(srv)
        executors = sorted(pids_titled(srv.proc.pid, "diffserve::executor"))
        assert len(executors) == 2
        victim = next(p for p in executors if "executor-1" in open(f"/proc/{p}/cmdline").read())

        def post(i: int, steps: int = 120) -> httpx.Response:
            with srv.client(timeout=120) as c:
                return c.post(GENERATE, json={"prompt": f"load {i}", "seed": i,
                                              "num_inference_steps": steps})

        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(post, i) for i in range(4)]  # two per executor, long ones
            wait_for_metric(srv, "diffserve_num_requests_running", lambda v: v >= 4)
            os.kill(victim, signal.SIGKILL)
            # Its death is published at once (its requests may run again on it once it is back).
            health = health_once(srv, lambda states: states[1] != "ready")
            first = [f.result() for f in futures]
            # The survivor keeps answering while its peer is down.
            quick = [pool.submit(post, 100 + i, 2) for i in range(4)]
            assert [r.status_code for r in quick_results(quick)] == [200] * 4
        assert [r.status_code for r in first] == [200] * 4, [r.text for r in first]
        assert srv.log.count("runs again: executor 1 exited unexpectedly") == 2
        loaded = load_model("tiny-sd", torch_threads=1)
        for i, r in enumerate(first):
            expected = solo(loaded, {}, make_request(prompt=f"load {i}", seed=i, steps=120))[0]
            assert max_diff(decode(r.json()["data"][0]["b64_json"]), expected) <= 2, i
        assert health.status_code == 200  # ready while one executor is
        assert health.json()["executors"][1]["state"] in ("restarting", "starting")
        body = wait_all_ready(srv)
        assert body["executors"][1]["restarts"] == 1 and body["executors"][0]["restarts"] == 0
        before = per_executor(httpx.get(srv.url + "/metrics").text, "diffserve_images_generated_total")
        with ThreadPoolExecutor(8) as pool:
            assert {r.status_code for r in pool.map(lambda i: post(200 + i, 30), range(8))} == {200}
        after = per_executor(httpx.get(srv.url + "/metrics").text, "diffserve_images_generated_total")
        assert after[0] > before[0] and after[1] > before[1], (before, after)
        text = httpx.get(srv.url + "/metrics").text
        assert metric(text, "diffserve_executor_restarts_total", executor="1") == 1
        assert metric(text, "diffserve_executor_restarts_total", executor="0") == 0


def quick_results(futures):
    return [f.result() for f in futures]
