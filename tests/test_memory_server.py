"""A memory budget through the real server (--device-memory-bytes on a CPU, with --offload
layer): the budget becomes the cost bound the scheduler admits by, so that no forward carries
more than it holds however many requests come at once; a request that could never fit gets 400
exceeds_memory_budget; /metrics shows the budget and what is admitted; /v1/models and the log say
where each component sits."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server import LAUNCHES, assert_openai_error, metric, serves, spec

BUDGET = 20_000_000  # tiny-flux: its weights, a 1 MB prompt cache, a call, and about 1.8 images


@pytest.fixture(scope="module")
@serves(spec("--batching-mode", "step", "--device-memory-bytes", str(BUDGET), "--offload", "layer",
             "--prompt-cache-bytes", "1000000", "--dynamic-batch-max-size", "8", model="tiny-flux"))
def server(request):
    with LAUNCHES.take(request) as srv:
        yield srv


def post(server, body) -> httpx.Response:
    with server.client(timeout=300) as c:
        return c.post("/v1/images/generations", json=body)


def test_the_budget_bounds_every_forward_and_refuses_what_never_fits(server):
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: post(server, {"prompt": f"p{i}", "seed": i,
                                                        "num_inference_steps": 4}), range(4)))
    assert [a.status_code for a in answers] == [200] * 4
    text = httpx.get(server.url + "/metrics").text
    forwards = metric(text, "diffserve_step_running_images_count")
    one_image = metric(text, "diffserve_step_running_images_bucket", le="1.0")
    assert forwards >= 16 and one_image == forwards  # the bound holds one image (cost 1.0) a set
    assert metric(text, "diffserve_memory_budget_bytes") == BUDGET
    assert 0 < metric(text, "diffserve_memory_admitted_bytes") <= BUDGET
    refused = post(server, {"prompt": "too big", "size": "512x512"})
    assert_openai_error(refused, 400, param="size", code="exceeds_memory_budget")


def test_models_and_the_log_say_where_each_component_sits(server):
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    where = {c["name"]: c for c in card["components"]}
    assert {"transformer", "vae", "text_encoder"} <= set(where)
    assert all(c["device"] == "cpu" and c["bytes"] > 0 for c in where.values())
    assert "transformer on cpu (offloaded)" in server.log
    assert "memory layout: --offload layer (dit)" in server.log
    assert "memory budget 20.0 MB" in server.log
