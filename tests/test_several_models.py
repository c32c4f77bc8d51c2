"""Several models in one server, as a user runs it (docs/models.md#several-models): three tiny
models with room for two awake, and a fourth entry that cannot load. One shared server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from helpers import make_request
from pace import scaled
from server import (
    LAUNCHES,
    assert_openai_error,
    decode,
    metric,
    serves,
    spec,
    wait_for_metric,
)

from diffserve.executor.checks.reference import solo
from diffserve.executor.model.loading import load_model

MODELS = {"sd": "tiny-sd", "xl": "tiny-sdxl", "px": "tiny-pixart-sigma"}
BROKEN = tempfile.mkdtemp(prefix="diffserve-not-a-model-")  # a directory with no pipeline in it
STEPS, GUIDANCE = 3, 5.0


@pytest.fixture(scope="module")
@serves(spec(*(arg for name, path in MODELS.items() for arg in ("--model", f"{name}={path}")),
             "--model", f"broken={BROKEN}", "--resident-models", "2",
             # A busy model always finishes its queue before a swap, and an idle one gives way
             # after 3 s (a tenth of the bound): the rest of a burst finds it awake.
             "--max-swap-wait-ms", "30000", "--dynamic-batch-max-size", "8",
             "--dynamic-batch-delay-ms", "100", model=None, timeout_s=300))
def server(request):
    srv = LAUNCHES.take(request).start()
    # One client for every thread: a client per request would build a TLS context each, and
    # spread a burst's arrivals over a second of the test process's CPU.
    with srv.client(timeout=300, limits=httpx.Limits(max_connections=64)) as srv.http:
        yield srv
    assert srv.stop() == 0, srv.log


@pytest.fixture(scope="module")
def reference():
    """Each model as its plain diffusers pipeline in this process: a request's solo image."""
    loaded = {name: load_model(path, torch_threads=1) for name, path in MODELS.items()}

    def alone(model: str, prompt: str, seed: int) -> np.ndarray:
        request = make_request(prompt=prompt, seed=seed, model=model, steps=STEPS,
                               guidance=GUIDANCE)
        return solo(loaded[model], {}, request)[0]

    return alone


def body(model: str, i: int) -> dict:
    return {"model": model, "prompt": f"request {i} for {model}", "seed": 100 + i,
            "num_inference_steps": STEPS, "guidance_scale": GUIDANCE}


def generate(server, payload: dict) -> httpx.Response:
    return server.http.post("/v1/images/generations", json=payload)


def swaps(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {name: metric(text, "diffserve_model_swaps_total", model=name) for name in MODELS}


def assert_own_image(response, reference, payload) -> None:
    assert response.status_code == 200, response.text
    got = decode(response.json()["data"][0]["b64_json"]).astype(int)
    want = reference(payload["model"], payload["prompt"], payload["seed"]).astype(int)
    assert np.abs(got - want).max() <= 2, payload


def test_the_models_are_listed_with_where_they_are(server):
    cards = {c["id"]: c for c in httpx.get(server.url + "/v1/models").json()["data"]}
    assert set(cards) == {*MODELS, "broken"}
    where = {name: cards[name]["location"] for name in MODELS}
    # The first two loaded; then the one loaded last slept, for the third to load.
    assert where == {"sd": "device", "xl": "host", "px": "device"}, where
    for name in MODELS:
        assert cards[name]["size_bytes"] > 0 and cards[name]["loaded_at"] > 0
    assert cards["px"]["loaded_at"] >= cards["xl"]["swapped_at"] >= cards["xl"]["loaded_at"]
    assert cards["broken"]["location"] == "failed" and cards["broken"]["error"]
    listed = subprocess.run([sys.executable, "-m", "diffserve", "models"], capture_output=True,
                            text=True, check=True).stdout
    assert all(f"{path}:" in listed for path in MODELS.values())


def test_an_unknown_name_is_a_404_naming_the_served_models(server):
    error = assert_openai_error(generate(server, body("nope", 0)), 404, "model", "model_not_found")
    assert all(repr(name) in error["message"] for name in MODELS)


def test_a_model_that_could_not_load_answers_503_with_why_while_the_others_serve(server):
    error = assert_openai_error(generate(server, body("broken", 0)), 503,
                                code="model_unavailable")
    assert "could not load" in error["message"]


def test_an_interleaved_burst_is_all_answered_each_by_its_own_model(server, reference):
    before = swaps(server)
    payloads = [body(name, i) for i in range(8) for name in MODELS]  # 24, interleaved
    with ThreadPoolExecutor(len(payloads)) as pool:
        responses = list(pool.map(lambda p: generate(server, p), payloads))
    for response, payload in zip(responses, payloads):
        assert_own_image(response, reference, payload)
    after = swaps(server)
    assert any(after[name] > before[name] for name in MODELS)  # px was swapped in
    assert all(after[name] - before[name] <= 2 for name in MODELS), (before, after)
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "diffserve_model_swap_seconds_count") >= 2
    assert metric(text, "diffserve_model_queue_depth") == 0


def executors(server) -> dict[str, list[dict]]:
    models = httpx.get(server.url + "/health").json()["models"]
    return {name: models[name]["executors"] for name in MODELS}


def test_an_executor_killed_mid_burst_leaves_nothing_unanswered_and_every_model_serves(
        server, reference):
    victim = executors(server)["sd"][0]["pid"]
    payloads = [body(name, 20 + i) for i in range(4) for name in MODELS]
    with ThreadPoolExecutor(len(payloads)) as pool:
        futures = [pool.submit(generate, server, p) for p in payloads]
        wait_for_metric(server, "diffserve_model_queue_depth", lambda v: v >= 1, model="sd")
        os.kill(victim, signal.SIGKILL)
        responses = [f.result() for f in futures]  # every one answered, none hangs
    for response, payload in zip(responses, payloads):
        if response.status_code == 200:
            assert_own_image(response, reference, payload)
        else:
            assert_openai_error(response, 503)
    deadline = time.monotonic() + scaled(120)
    while not all(e["state"] == "ready" for ex in executors(server).values() for e in ex):
        assert time.monotonic() < deadline, executors(server)
        time.sleep(0.1)  # the restart has no event a client can wait on; /health is the probe
    assert executors(server)["sd"][0]["pid"] != victim
    assert executors(server)["sd"][0]["restarts"] == 1
    for name in MODELS:  # every model serves afterwards, each its own images
        payload = body(name, 40)
        assert_own_image(generate(server, payload), reference, payload)


@pytest.mark.slow  # a second executor restart (the mid-burst kill above runs by default)
def test_an_executor_killed_while_its_model_is_swapped_in_comes_back_and_serves(server, reference):
    cards = {c["id"]: c for c in httpx.get(server.url + "/v1/models").json()["data"]}
    (asleep,) = [name for name in MODELS if cards[name]["location"] == "host"]
    victim = executors(server)[asleep][0]["pid"]
    payloads = [body(asleep, 60 + i) for i in range(3)]
    with ThreadPoolExecutor(len(payloads)) as pool:
        futures = [pool.submit(generate, server, p) for p in payloads]
        wait_for_metric(server, "diffserve_model_queue_depth", lambda v: v >= 1, model=asleep)
        os.kill(victim, signal.SIGKILL)  # its model is asleep, or being woken, for these
        responses = [f.result() for f in futures]
    for response, payload in zip(responses, payloads):
        if response.status_code == 200:
            assert_own_image(response, reference, payload)
        else:
            assert_openai_error(response, 503)
    deadline = time.monotonic() + scaled(120)
    while not all(e["state"] == "ready" for ex in executors(server).values() for e in ex):
        assert time.monotonic() < deadline, executors(server)
        time.sleep(0.1)  # the restart has no event a client can wait on; /health is the probe
    payload = body(asleep, 70)
    assert_own_image(generate(server, payload), reference, payload)
    cards = {c["id"]: c for c in httpx.get(server.url + "/v1/models").json()["data"]}
    assert cards[asleep]["location"] == "device"


@pytest.fixture(scope="module")
@serves(spec("--model", "sd=tiny-sd", "--model", "px=tiny-pixart-sigma", "--resident-models", "1",
             # Every model put to sleep passes the host budget: it sleeps on disk (level 2).
             "--resident-host-bytes", "1", "--max-swap-wait-ms", "2000", model=None,
             timeout_s=300))
def on_disk(request):
    srv = LAUNCHES.take(request).start()
    with srv.client(timeout=300) as srv.http:
        yield srv
    assert srv.stop() == 0, srv.log


def test_a_model_asleep_on_disk_past_the_host_budget_wakes_and_serves_exactly(on_disk, reference):
    def where() -> dict[str, str]:
        return {c["id"]: c["location"] for c in httpx.get(on_disk.url + "/v1/models").json()["data"]}

    assert where() == {"sd": "disk", "px": "device"}  # sd slept for px to load, past the budget
    for name in ("sd", "px"):  # each woken from disk (its weights read again from its files)
        payload = body(name, 80)
        assert_own_image(generate(on_disk, payload), reference, payload)
        assert where()[name] == "device"
    assert where() == {"sd": "disk", "px": "device"}
