"""The online-RL control routes through the real server (--enable-weight-updates): weights from
disk and from a trainer's tensors in shared memory make the images diffusers makes with them,
each answer names its version; drain lets running work finish on the old weights, abort ends it;
an update that does not fit is refused and the old version keeps serving; sleeping at level 2 and
waking give the same images, and a request sent meanwhile waits; a restarted executor serves the
current version."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from diffserve.client import Client
from diffserve.executor.model.loading import load_model
from helpers import make_request
from pace import scaled
from diffserve.executor.checks.reference import max_diff, solo
from server import LAUNCHES, assert_openai_error, decode, metric, pids_titled, serves, spec, wait_for_metric

MODEL = "tiny-flux"
GENERATE = "/v1/images/generations"
# Known before the server launches (ahead of the tests): this worker's own directory.
WEIGHTS_DIR = Path(tempfile.gettempdir()) / f"diffserve-test-weights-{os.getpid()}"
BODY = {"prompt": "a red circle", "seed": 5, "num_inference_steps": 3, "guidance_scale": 3.5}


@pytest.fixture(scope="module")
@serves(spec("--batching-mode", "step", "--enable-weight-updates", "--weights-dir", str(WEIGHTS_DIR),
             "--max-inference-steps", "2000", "--dynamic-batch-max-size", "4", model=MODEL))
def server(request):
    WEIGHTS_DIR.mkdir(exist_ok=True)
    with LAUNCHES.take(request) as srv:
        yield srv
    shutil.rmtree(WEIGHTS_DIR, ignore_errors=True)


@pytest.fixture(scope="module")
def reference():
    """diffusers alone, on a fresh copy of the model: ``images(state)`` with ``state`` loaded."""
    loaded = load_model(MODEL, torch_threads=1)
    base = {k: v.clone() for k, v in loaded.pipe.transformer.state_dict().items()}

    def images(state=None):
        loaded.pipe.transformer.load_state_dict(state or base)
        r = make_request(model=MODEL, prompt=BODY["prompt"], seed=BODY["seed"],
                         steps=BODY["num_inference_steps"], guidance=BODY["guidance_scale"])
        return solo(loaded, {}, r)

    images.base = base
    return images


def trained(base: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in base.items()}


def on_disk(state: dict, name: str) -> str:
    """``state`` as a directory in diffusers' layout inside --weights-dir; its name there."""
    folder = WEIGHTS_DIR / name / "transformer"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "diffusion_pytorch_model.safetensors"))
    return name


def generate(server, body=None) -> httpx.Response:
    with server.client(timeout=600) as c:
        return c.post(GENERATE, json=body or BODY)


def update(server, **body) -> httpx.Response:
    with server.client(timeout=600) as c:
        return c.post("/v1/update_weights", json=body)


def image_and_version(server):
    response = generate(server)
    assert response.status_code == 200, response.text
    return decode(response.json()["data"][0]["b64_json"])[None], response.json()["weight_version"]


def test_an_update_from_disk_serves_its_images_and_a_bad_one_keeps_the_old(server, reference):
    image, version = image_and_version(server)
    assert version == "0" and max_diff(image, reference()) <= 2
    state = trained(reference.base, seed=1)
    answer = update(server, path=on_disk(state, "step-1"))
    assert answer.status_code == 200, answer.text
    assert answer.json()["weight_version"] == "1" and answer.json()["applied_at"] <= time.time()
    image, version = image_and_version(server)
    assert version == "1" and max_diff(image, reference(state)) <= 2
    models = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert models["weight_version"] == "1"

    key = next(iter(state))
    save_file({**state, key: torch.zeros(2, 2)}, str(WEIGHTS_DIR / "misfit.safetensors"))
    refused = update(server, path="misfit.safetensors")
    assert_openai_error(refused, 400, param="path", code="invalid_weights")
    assert repr(key) in refused.json()["error"]["message"]
    outside = Path(tempfile.mkdtemp())
    assert_openai_error(update(server, path=str(outside)), 403, param="path")
    assert_openai_error(update(server, path="step-1", tensors={"shared_memory": "x.safetensors"}),
                        400, param="path")
    assert_openai_error(update(server, path="step-1", learning_rate=1), 400, code="unknown_parameter")
    assert_openai_error(update(server, tensors={"shared_memory": "../etc.safetensors"}), 400)
    again, version = image_and_version(server)
    assert version == "1" and max_diff(again, image) == 0  # the old weights keep serving
    assert metric(httpx.get(server.url + "/metrics").text, "diffserve_weight_updates_total",
                  outcome="refused") >= 1


def test_tensors_from_the_trainers_memory_and_the_version_on_rollouts(server, reference):
    state = trained(reference.base, seed=2)
    with Client(server.url) as client:
        before = client.rollout("a red circle", n=2, num_inference_steps=2)[0].weight_version
        answer = client.update_weights(tensors=state)
        assert int(answer["weight_version"]) == int(before) + 1
        (group,) = client.rollout("a red circle", n=2, num_inference_steps=2)
        assert group.weight_version == answer["weight_version"]
    image, version = image_and_version(server)
    assert version == answer["weight_version"] and max_diff(image, reference(state)) <= 2


def running(server) -> None:
    wait_for_metric(server, "diffserve_num_requests_running", lambda v: v >= 1)


def test_drain_lets_running_work_finish_on_the_old_weights_and_abort_ends_it(server, reference):
    _, old = image_and_version(server)
    long = {**BODY, "num_inference_steps": 900, "seed": 9}
    finished = {}
    with ThreadPoolExecutor(3) as pool:
        slow = pool.submit(lambda: (generate(server, long), finished.setdefault("at", time.time())))
        running(server)
        drained = pool.submit(update, server, path=on_disk(trained(reference.base, 3), "step-3"),
                              weight_version="drained")
        wait_for_metric(server, "diffserve_queue_held", lambda v: v == 1)  # the update began
        second = update(server, path="step-3")  # one command at a time
        assert_openai_error(second, 409, code="busy")
        response, _ = slow.result()
        applied = drained.result()
    assert response.status_code == 200 and response.json()["weight_version"] == old
    assert applied.status_code == 200 and applied.json()["weight_version"] == "drained"
    assert applied.json()["applied_at"] >= finished["at"] - 1  # after the running request
    assert image_and_version(server)[1] == "drained"

    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(generate, server, long)
        running(server)
        aborted = update(server, path="step-1", mode="abort", weight_version="aborted")
        assert aborted.status_code == 200, aborted.text
        assert_openai_error(slow.result(), 503, code="weights_updated")


def test_sleep_and_wake_give_the_same_images_and_requests_wait_meanwhile(server):
    before, version = image_and_version(server)
    with server.client(timeout=60) as c:
        assert c.post("/v1/sleep", json={"level": 2}).json() == {"is_sleeping": True, "level": 2}
        assert c.get("/v1/is_sleeping").json() == {"is_sleeping": True, "level": 2}
        assert c.get("/health").status_code == 200  # an orchestrator must not restart it
        assert metric(c.get("/metrics").text, "diffserve_sleeping") == 2
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(generate, server)
        wait_for_metric(server, "diffserve_num_requests_waiting", lambda v: v >= 1)
        assert not waiting.done()
        with server.client(timeout=600) as c:
            woke = c.post("/v1/wake_up")
        assert woke.status_code == 200 and woke.json()["is_sleeping"] is False
        response = waiting.result()
    assert response.status_code == 200 and response.json()["weight_version"] == version
    assert max_diff(decode(response.json()["data"][0]["b64_json"])[None], before) == 0
    assert metric(httpx.get(server.url + "/metrics").text, "diffserve_sleeping") == 0


def test_a_restarted_executor_serves_the_current_version(server, reference):
    state = trained(reference.base, seed=4)
    assert update(server, path=on_disk(state, "step-4"), weight_version="restart").status_code == 200
    (pid,) = pids_titled(server.proc.pid, "diffserve::executor-0")
    os.kill(pid, signal.SIGKILL)
    wait_for_metric(server, "diffserve_executor_restarts_total", lambda v: v >= 1)
    deadline = time.monotonic() + scaled(120)
    while httpx.get(server.url + "/health").status_code != 200:  # ready again: no event here
        assert time.monotonic() < deadline, "the executor did not come back"
        time.sleep(0.2)
    image, version = image_and_version(server)
    assert version == "restart" and max_diff(image, reference(state)) <= 2


def test_the_documented_online_grpo_example_closes_the_loop(server):
    """examples/grpo_loop.py against this server, as docs/rl.md runs it: rollouts, a training
    step, the weights sent from memory, rollouts by the new version; the trainer's log-
    probabilities recomputed from the server's trajectories agree with the server's (ratio 1),
    which holds only if the server applied exactly the trainer's weights."""
    import subprocess
    import sys

    example = Path(__file__).parent.parent / "examples" / "grpo_loop.py"
    run = subprocess.run([sys.executable, str(example), "--url", server.url, "--iterations", "2",
                          "--n", "4", "--steps", "2"], capture_output=True, text=True,
                         timeout=scaled(300))
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("iteration")]
    assert len(lines) == 2, run.stdout
    versions = [line.split("by version ")[1].split(",")[0] for line in lines]
    served = [line.rsplit("version ", 1)[1] for line in lines]
    assert versions == ["step-0", "step-1"] and served == ["step-1", "step-2"]
    for line in lines:
        assert float(line.split("ratio off 1 by ")[1].split(";")[0]) < 1e-4, line
