"""The server as a user runs it: a real ``diffserve serve`` subprocess, real HTTP, real ZMQ."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffserve.executor.model.loading import load_model
from helpers import make_request
from diffserve.executor.checks.reference import solo
from server import (
    LAUNCHES,
    assert_openai_error,
    decode,
    descendants,
    metric,
    pids_titled,
    process_title,
    serves,
    session_members,
    spec,
)
from pace import scaled

METRIC_NAMES = [
    "diffserve_requests_total", "diffserve_num_requests_waiting", "diffserve_num_requests_running",
    "diffserve_batch_size", "diffserve_queue_time_seconds", "diffserve_request_latency_seconds",
    "diffserve_batch_execution_seconds", "diffserve_images_generated_total",
]


@pytest.fixture(scope="module")
@serves(spec("--dynamic-batch-max-size", "8", "--dynamic-batch-delay-ms", "50"))
def server(request):
    srv = LAUNCHES.take(request).start()
    pid = srv.proc.pid
    yield srv
    assert srv.stop() == 0, srv.log
    assert session_members(pid) == [], "processes left behind after shutdown"


@pytest.fixture(scope="module")
def reference():
    """The same model, as the plain diffusers pipeline in this process: each request's solo image."""
    loaded = load_model("tiny-sd", torch_threads=1)

    def alone(prompt: str, seed: int, negative_prompt: str = "") -> np.ndarray:
        request = make_request(prompt=prompt, seed=seed, negative_prompt=negative_prompt)
        return solo(loaded, {}, request)[0]

    return alone


def test_processes_are_named(server):
    titles = [process_title(p) for p in [server.proc.pid, *descendants(server.proc.pid)]]
    for name in ("diffserve::frontend", "diffserve::scheduler", "diffserve::executor"):
        assert any(t.startswith(name) for t in titles), titles


def test_health_models_and_metric_names(server):
    with server.client() as c:
        assert c.get("/health").json()["status"] == "ok"
        models = c.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "tiny-sd"
        text = c.get("/metrics").text
    for name in METRIC_NAMES:
        assert name in text, name


def test_concurrent_requests_are_batched_and_each_gets_its_own_image(server, reference):
    count = 16
    bodies = [{"prompt": f"request number {i}: a {['red', 'green', 'blue', 'white'][i % 4]} shape",
               "seed": 1000 + 37 * i} for i in range(count)]
    with server.client() as c:
        before = c.get("/metrics").text
        with ThreadPoolExecutor(count) as pool:
            responses = list(pool.map(lambda b: c.post("/v1/images/generations", json=b), bodies))
        after = c.get("/metrics").text
    assert [r.status_code for r in responses] == [200] * count, [r.text for r in responses]
    calls = metric(after, "diffserve_batch_size_count") - metric(before, "diffserve_batch_size_count")
    images = metric(after, "diffserve_batch_size_sum") - metric(before, "diffserve_batch_size_sum")
    assert images == count
    assert calls < count, f"{count} requests took {calls} executor calls: nothing was batched"
    got = []
    for body, response in zip(bodies, responses):
        data = response.json()["data"]
        assert len(data) == 1 and data[0]["seed"] == body["seed"]
        image = decode(data[0]["b64_json"])
        assert image.shape == (64, 64, 3)
        diff = np.abs(image.astype(int) - reference(body["prompt"], body["seed"]).astype(int)).max()
        assert diff <= 2, f"{body['prompt']!r}: differs from its solo run by {diff}/255"
        got.append(image)
    for i in range(count):
        for j in range(i + 1, count):
            assert not np.array_equal(got[i], got[j])


def test_n_images_use_consecutive_seeds(server, reference):
    with server.client() as c:
        r = c.post("/v1/images/generations", json={"prompt": "three of them", "n": 3, "seed": 5})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["seed"] for d in data] == [5, 6, 7]
    images = [decode(d["b64_json"]) for d in data]
    for seed, image in zip([5, 6, 7], images):
        assert np.abs(image.astype(int) - reference("three of them", seed).astype(int)).max() <= 2
    assert not np.array_equal(images[0], images[1]) and not np.array_equal(images[1], images[2])


def test_n_above_the_batch_size_is_split_and_answered_together(server):
    with server.client() as c:
        r = c.post("/v1/images/generations", json={"prompt": "many", "n": 10, "seed": 1})
    assert r.status_code == 200, r.text
    assert [d["seed"] for d in r.json()["data"]] == list(range(1, 11))


def test_seeds_wrap_at_32_bits_and_every_returned_seed_is_accepted_again(server, reference):
    with server.client() as c:
        r = c.post("/v1/images/generations", json={"prompt": "wraps", "n": 2, "seed": 2**32 - 1})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["seed"] for d in data] == [2**32 - 1, 0]
        again = c.post("/v1/images/generations", json={"prompt": "wraps", "seed": data[1]["seed"]})
    assert again.status_code == 200
    assert np.abs(decode(data[1]["b64_json"]).astype(int)
                  - reference("wraps", 0).astype(int)).max() <= 2


def test_server_drawn_seed_is_reported_and_reproducible(server):
    with server.client() as c:
        first = c.post("/v1/images/generations", json={"prompt": "seedless"}).json()["data"][0]
        again = c.post("/v1/images/generations",
                       json={"prompt": "seedless", "seed": first["seed"]}).json()["data"][0]
    assert np.abs(decode(first["b64_json"]).astype(int) - decode(again["b64_json"]).astype(int)).max() <= 2


@pytest.mark.parametrize("fmt, pil_format", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_output_formats_and_sizes(server, fmt, pil_format):
    with server.client() as c:
        r = c.post("/v1/images/generations", json={
            "prompt": "formats", "output_format": fmt, "output_compression": 80, "size": "128x64",
            "num_inference_steps": 2, "guidance_scale": 1.0, "negative_prompt": "blurry"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_format"] == fmt and body["size"] == "128x64"
    image = Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"])))
    assert image.format == pil_format and image.size == (128, 64)


def test_openai_client_works_unchanged(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    result = client.images.generate(model="tiny-sd", prompt="from the official client", n=2,
                                    size="64x64", response_format="b64_json",
                                    extra_body={"seed": 42, "num_inference_steps": 3})
    assert len(result.data) == 2
    assert [d.model_extra["seed"] for d in result.data] == [42, 43]
    assert decode(result.data[0].b64_json).shape == (64, 64, 3)
    with pytest.raises(openai.NotFoundError):
        client.images.generate(model="dall-e-3", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.images.generate(prompt="x", size="63x64")


BAD_INPUTS = [
    ({}, 400, "prompt", "missing_required_parameter"),
    ({"prompt": ""}, 400, "prompt", None),
    ({"prompt": "   "}, 400, "prompt", None),
    ({"prompt": 5}, 400, "prompt", None),
    ({"prompt": "x", "n": 0}, 400, "n", None),
    ({"prompt": "x", "n": 11}, 400, "n", None),
    ({"prompt": "x", "n": "2"}, 400, "n", None),
    ({"prompt": "x", "n": True}, 400, "n", None),
    ({"prompt": "x", "size": "65x64"}, 400, "size", "invalid_size"),
    ({"prompt": "x", "size": "64"}, 400, "size", "invalid_size"),
    ({"prompt": "x", "size": "0x64"}, 400, "size", "invalid_size"),
    ({"prompt": "x", "size": "4096x4096"}, 400, "size", "invalid_size"),
    ({"prompt": "x", "response_format": "url", "stream": True}, 400, "response_format", None),
    ({"prompt": "x", "response_format": "gif"}, 400, "response_format", None),
    ({"prompt": "x", "output_format": "gif"}, 400, "output_format", None),
    ({"prompt": "x", "output_compression": 101}, 400, "output_compression", None),
    ({"prompt": "x", "seed": -1}, 400, "seed", None),
    ({"prompt": "x", "seed": 2**40}, 400, "seed", None),
    ({"prompt": "x", "num_inference_steps": 0}, 400, "num_inference_steps", None),
    ({"prompt": "x", "num_inference_steps": 100000}, 400, "num_inference_steps", None),
    ({"prompt": "x", "guidance_scale": -1}, 400, "guidance_scale", None),
    ({"prompt": "x", "guidance_scale": "high"}, 400, "guidance_scale", None),
    ({"prompt": "x", "mystery": 1}, 400, "mystery", "unknown_parameter"),
    ({"prompt": "x" * 5000}, 400, "prompt", None),
    ({"prompt": "x", "model": "no-such-model"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("body, status, param, code", BAD_INPUTS)
def test_bad_input_gets_an_openai_error(server, body, status, param, code):
    with server.client() as c:
        before = metric(c.get("/metrics").text, "diffserve_batch_size_count")
        r = c.post("/v1/images/generations", json=body)
        assert_openai_error(r, status, param, code)
        assert metric(c.get("/metrics").text, "diffserve_batch_size_count") == before


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b"null", b'"prompt"', b"\xff\xfe"])
def test_malformed_bodies_get_400(server, raw):
    with server.client() as c:
        assert_openai_error(c.post("/v1/images/generations", content=raw), 400)


def test_plain_curl_style_post_without_content_type_works(server):
    with server.client() as c:
        r = c.post("/v1/images/generations", content=b'{"prompt": "curl", "n": 2, "seed": 5}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and len(r.json()["data"]) == 2


def test_unknown_route_and_method_use_the_error_shape(server):
    with server.client() as c:
        assert_openai_error(c.get("/v1/nothing"), 404)
        assert_openai_error(c.get("/v1/images/generations"), 405)


def test_the_frontend_and_the_scheduler_never_load_torch(server):
    """After serving every test above, neither the HTTP process nor the scheduler has torch's
    libraries mapped: only the executors run the model."""
    with server.client() as c:
        assert c.post("/v1/images/generations", json={"prompt": "x", "seed": 1}).status_code == 200
    (scheduler,) = pids_titled(server.proc.pid, "diffserve::scheduler")
    for pid in (server.proc.pid, scheduler):
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps and "torch/_C" not in maps, process_title(pid)
    (executor,) = pids_titled(server.proc.pid, "diffserve::executor")
    assert "libtorch" in Path(f"/proc/{executor}/maps").read_text()  # the check can fail


def test_the_openapi_document_reports_the_package_version(server):
    from importlib.metadata import version

    with server.client() as c:
        assert c.get("/openapi.json").json()["info"]["version"] == version("diffserve")


@pytest.mark.server("--model", "tiny-flux", "--dynamic-batch-max-size", "4")
def test_flux_family_serves_end_to_end(own_server):
    with own_server as srv, srv.client() as c:
        r = c.post("/v1/images/generations", json={"prompt": "a flux image", "n": 2, "seed": 3})
        assert r.status_code == 200, r.text
        assert [decode(d["b64_json"]).shape for d in r.json()["data"]] == [(64, 64, 3)] * 2
        assert_openai_error(c.post("/v1/images/generations", json={"prompt": "x", "size": "72x64"}),
                            400, "size")


@pytest.mark.parametrize("model, message", [
    ("./no/such/dir", "no such directory"),
    ("tests", "could not load model"),
])
@pytest.mark.server("--model", "{model}")
def test_a_model_that_cannot_load_stops_the_server_with_a_clear_message(model, message,
                                                                       own_server):
    srv = own_server
    assert srv.proc.wait(scaled(120)) == 1
    assert message in srv.log, srv.log
