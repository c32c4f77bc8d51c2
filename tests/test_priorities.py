"""Priority classes served as a user runs them: an interactive request that finds the running
set full pauses a batch request of a worse class at a step boundary, finishes first, and the
batch request resumes where it left off: both images equal the plain pipeline alone. Per-key
classes apply, and the per-class figures say so."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from diffserve.config.flags import ServerConfig
from diffserve.errors import APIError
from diffserve.executor.model.loading import load_model
from diffserve.frontend.schemas import ImageGenerationRequest
from diffserve.frontend.spec import generation_spec
from diffserve.frontend.validation import to_engine_request
from diffserve.wire.model_info import ModelInfo
from diffserve.wire.tasks import GENERATE
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, solo
from server import LAUNCHES, decode, metric, serves, spec, wait_for_metric

KEYS = {"interactive": "interactive-key", "trainer": "trainer-key"}


@pytest.fixture(scope="module")
@serves(spec("--scheduling-policy", "priority", "--priority-aging-s", "0",
             "--dynamic-batch-max-size", "1", "--max-inference-steps", "1000",
             "--api-key", KEYS["interactive"], "--api-key", f"{KEYS['trainer']}:10"))
def server(request):
    with LAUNCHES.take(request) as srv:
        yield srv


def post(server, who: str, body: dict):
    with server.client(headers={"Authorization": f"Bearer {KEYS[who]}"}) as c:
        response = c.post("/v1/images/generations", json=body)
    return response, time.monotonic()


def test_an_interactive_request_preempts_a_batch_one_and_both_are_exact(server):
    batch = {"prompt": "a long batch job", "seed": 3, "num_inference_steps": 120}
    urgent = {"prompt": "an interactive one", "seed": 4, "num_inference_steps": 4}
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(post, server, "trainer", batch)
        wait_for_metric(server, "diffserve_num_requests_running", lambda v: v >= 1)
        fast = pool.submit(post, server, "interactive", urgent)
        (r_slow, t_slow), (r_fast, t_fast) = slow.result(), fast.result()
    assert r_slow.status_code == r_fast.status_code == 200
    assert t_fast < t_slow  # it did not wait for the 120 steps
    with server.client() as c:
        text = c.get("/metrics").text
    assert metric(text, "diffserve_preemptions_total") >= 1
    loaded = load_model("tiny-sd", torch_threads=1)
    for body, response in ((batch, r_slow), (urgent, r_fast)):
        request = make_request(prompt=body["prompt"], seed=body["seed"],
                               steps=body["num_inference_steps"])
        assert max_diff(decode(response.json()["data"][0]["b64_json"]),
                        solo(loaded, {}, request)[0]) <= 2


def test_a_keys_class_is_its_requests_default_and_best(server):
    def counted(text, priority):
        return metric(text, "diffserve_class_request_latency_seconds_count", priority=priority)

    with server.client() as c:
        before = c.get("/metrics").text
    body = {"prompt": "x", "num_inference_steps": 2}
    assert post(server, "trainer", {**body, "priority": 0})[0].status_code == 200  # lowered to 10
    assert post(server, "trainer", {**body, "priority": 12})[0].status_code == 200  # worse: kept
    assert post(server, "interactive", body)[0].status_code == 200
    with server.client() as c:
        after = c.get("/metrics").text
    assert counted(after, "10") - counted(before, "10") == 1
    assert counted(after, "12") - counted(before, "12") == 1
    assert counted(after, "0") - counted(before, "0") == 1
    assert metric(after, "diffserve_class_queue_time_seconds_count", priority="10") >= 1


def test_a_priority_needs_the_priority_policy():
    info = ModelInfo("m", "P", 64, 64, 8, 4, 1000, 4.0, True, "cpu", "float32", "step",
                     ["generate"], True)
    body = ImageGenerationRequest(prompt="x", priority=3)
    with pytest.raises(APIError) as caught:
        to_engine_request(generation_spec(body), "r", info, ServerConfig(), GENERATE)
    assert (caught.value.status, caught.value.param) == (400, "priority")
    assert "--scheduling-policy priority" in caught.value.message
    zero = generation_spec(ImageGenerationRequest(prompt="x", priority=0))
    assert to_engine_request(zero, "r", info, ServerConfig(), GENERATE).priority == 0
    config = ServerConfig(scheduling_policy="priority")
    assert to_engine_request(generation_spec(body), "r", info, config, GENERATE).priority == 3


def test_api_keys_with_classes_are_read_and_checked():
    from diffserve.cli import build_parser
    from diffserve.config.flags import ConfigError

    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority", "--api-key",
                                      "plain", "--api-key", "trainer:10", "odd:key", "neg:-2"])
    config = ServerConfig.from_mapping(vars(args))
    assert config.api_keys == {"plain": None, "trainer": 10, "odd:key": None, "neg": -2}
    with pytest.raises(ConfigError, match="only --scheduling-policy priority uses"):
        ServerConfig(api_key=("trainer:10",))
    assert "trainer" not in repr(config)  # keys stay out of logs
