"""The accelerators through the real server: a step cache per request (its threshold in the
request, its cached steps in the usage, its rows in /metrics) over an int8 dynamic-quantized
denoiser whose attention kernel the server timed and chose itself; the model's FLOPs and their
utilisation in /metrics; requests that ask for what the server does not run are refused."""

from __future__ import annotations

import httpx
import pytest

from server import LAUNCHES, assert_openai_error, metric, serves, spec, wait_for_metric

GENERATE = "/v1/images/generations"


@pytest.fixture(scope="module")
@serves(spec("--batching-mode", "step", "--step-cache", "first-block", "--quantization",
             "int8-dynamic", "--attention-backend", "auto", "--device-peak-tflops", "0.01",
             "--max-inference-steps", "100", model="tiny-flux"))
def server(request):
    pytest.importorskip("torchao")
    with LAUNCHES.take(request) as srv:
        yield srv


def post(server, body: dict, path: str = GENERATE) -> httpx.Response:
    with server.client(timeout=120) as c:
        return c.post(path, json=body)


def test_each_request_caches_with_its_own_threshold_and_reports_it(server):
    cached = post(server, {"prompt": "a cat", "seed": 1, "num_inference_steps": 10, "n": 2,
                           "cache_threshold": 1.0})
    plain = post(server, {"prompt": "a cat", "seed": 1, "num_inference_steps": 10})
    assert cached.status_code == 200 and plain.status_code == 200, (cached.text, plain.text)
    steps = cached.json()["usage"]["cached_steps"]
    assert 0 < steps <= 2 * (10 - 2)  # each image computes its first and last steps
    assert plain.json()["usage"]["cached_steps"] == 0  # the server's default threshold is 0
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "diffserve_step_cache_rows_total", outcome="hit", executor="0") == steps
    assert metric(text, "diffserve_step_cache_rows_total", outcome="miss", executor="0") > 0
    assert metric(text, "diffserve_step_host_seconds_count", executor="0") > 0
    assert metric(text, "diffserve_step_cache_bytes", executor="0") == 0  # nothing runs now
    assert "--quantization int8-dynamic" in server.log
    assert "encode and decode stages off (on the loop)" in server.log  # --stages auto, a CPU


def test_quantization_that_runs_leaves_no_import_noise_in_the_log(server):
    """torchao and what imports it log, as they import, kernels this machine lacks, a torch
    deprecation and diffusers' older list of torchao classes: none of it tells an operator
    anything where quantization runs."""
    post(server, {"prompt": "a cat", "num_inference_steps": 2})
    for noise in ("Failed to load", "_C_mxfp8", "Unable to import `torchao`", "Enum subclass"):
        assert noise not in server.log, noise


def test_models_shows_what_was_chosen_and_metrics_count_the_models_flops(server):
    (card,) = httpx.get(server.url + "/v1/models").json()["data"]
    speed = card["speed"]
    attention = speed["attention"]
    # On a CPU: torch's kernels that run here were timed; the CUDA ones left out, saying why.
    assert {"native", "math", "torch-flash"} <= set(attention["step_ms"]), attention
    assert attention["backend"] in attention["step_ms"]
    assert "needs a CUDA GPU" in attention["left_out"]["cudnn"]
    quantized = speed["quantization"]
    assert quantized["scheme"] == "int8-dynamic" and quantized["scope"] == "blocks"
    assert quantized["layers"] > 0 and quantized["psnr_db"] > 30, quantized
    assert speed["flops"]["per_step_native"] > 0 and speed["flops"]["device_peak_tflops"] == 0.01
    before = metric(httpx.get(server.url + "/metrics").text, "diffserve_model_flops_total",
                    executor="0")
    assert post(server, {"prompt": "a cat", "num_inference_steps": 4}).status_code == 200
    # Four forwards of one native-size image (no guidance on FLUX.1: one row a step); the
    # last step's count may land just after the answer.
    expected = before + 4 * speed["flops"]["per_step_native"]
    done = wait_for_metric(server, "diffserve_model_flops_total", lambda v: v >= expected * 0.999,
                           executor="0")
    assert done == pytest.approx(expected)
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "diffserve_model_flops_utilization", executor="0") > 0


def test_rollouts_are_never_cached(server):
    response = post(server, {"prompt": "a cat", "cache_threshold": 0.5}, "/v1/rollouts")
    assert_openai_error(response, 400, param="cache_threshold")


def test_a_server_without_a_step_cache_refuses_a_threshold():
    from diffserve.config.flags import ServerConfig
    from diffserve.errors import APIError
    from diffserve.frontend.schemas import ImageGenerationRequest
    from diffserve.frontend.spec import generation_spec
    from diffserve.frontend.validation import to_engine_request
    from diffserve.wire.model_info import ModelInfo
    from diffserve.wire.tasks import GENERATE as TASK

    info = ModelInfo("m", "StableDiffusionPipeline", 64, 64, 8, 4, 1000, 5.0, True, "cpu",
                     "float32", "step", ["generate"], True)
    body = ImageGenerationRequest(prompt="x", cache_threshold=0.3)
    with pytest.raises(APIError) as refused:
        to_engine_request(generation_spec(body), "r", info, ServerConfig(), TASK)
    assert refused.value.param == "cache_threshold" and "--step-cache" in str(refused.value)
    # Zero asks for nothing, and a server that caches takes any threshold.
    zero = generation_spec(ImageGenerationRequest(prompt="x", cache_threshold=0.0))
    assert to_engine_request(zero, "r", info, ServerConfig(), TASK).cache_threshold == 0.0
    import dataclasses

    accepted = to_engine_request(generation_spec(body), "r",
                                 dataclasses.replace(info, step_cache=True), ServerConfig(), TASK)
    assert accepted.cache_threshold == 0.3
