"""Sizes in one forward through the real server (tiny Flux, step mode): six concurrent requests
of five sizes and aspect ratios share one running set, each image equals the plain pipeline
alone, and /metrics and /v1/models say how sizes share forwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from diffserve.config.flags import ServerConfig
from diffserve.executor.checks.reference import max_diff, solo
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.runtime import build_runtime
from helpers import make_request
from server import LAUNCHES, decode, metric, serves, spec

MODEL = "tiny-flux"
SIZES = ["64x64", "96x64", "64x96", "48x48", "80x80", "64x64"]


@pytest.fixture(scope="module")
# Six images make a full batch, dispatched as soon as all six are in; the cost bound leaves room
# for all six rows padded to the largest (80x80: 1.56 native rows each).
@serves(spec("--batching-mode", "step", "--dynamic-batch-max-size", "6",
             "--dynamic-batch-delay-ms", "3000", "--max-batch-cost", "16",
             "--skip-startup-check", model=MODEL))
def server(request):
    with LAUNCHES.take(request) as srv:
        yield srv


def test_six_requests_of_five_sizes_share_forwards_and_equal_their_solo_runs(server):
    bodies = [{"prompt": f"a picture {i}", "size": size, "seed": 20 + i,
               "num_inference_steps": 6 + i % 3} for i, size in enumerate(SIZES)]
    with ThreadPoolExecutor(len(bodies)) as pool, server.client(timeout=300) as c:
        answers = list(pool.map(lambda b: c.post("/v1/images/generations", json=b), bodies))
    assert [a.status_code for a in answers] == [200] * len(bodies), [a.text for a in answers]
    text = httpx.get(server.url + "/metrics").text
    forwards = metric(text, "diffserve_step_running_images_count")
    images = metric(text, "diffserve_step_running_images_sum")
    assert images / forwards >= 3, (images, forwards)
    assert metric(text, "diffserve_steps_total", executor="0", size="mixed") >= 1
    assert metric(text, "diffserve_forward_padding_fraction_count") == forwards
    assert metric(text, "diffserve_forward_padding_fraction_sum") > 0
    assert metric(text, "diffserve_forward_tokens_sum") > 0
    loaded = load_model(MODEL, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe)
    for body, answer in zip(bodies, answers):
        width, height = map(int, body["size"].split("x"))
        request = make_request(model=MODEL, prompt=body["prompt"], seed=body["seed"],
                               steps=body["num_inference_steps"], width=width, height=height)
        got = decode(answer.json()["data"][0]["b64_json"])
        assert got.shape == (height, width, 3)
        assert max_diff(got, solo(loaded, pipelines, request)[0]) <= 2, body


def test_models_say_which_tasks_mix_sizes(server):
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["mixed_sizes"]["generate"] == ""
    assert all(why == "" for task, why in card["mixed_sizes"].items()
               if "+" not in task), card["mixed_sizes"]


def test_a_unet_family_and_size_mixing_off_keep_one_set_per_size():
    flux = build_runtime(ServerConfig(model=MODEL, size_mixing="off", skip_startup_check=True))
    assert set(flux.mixed_sizes.values()) == {"--size-mixing off"}
    assert flux.step_engine().mixed_sizes == frozenset()
    sd = build_runtime(ServerConfig(model="tiny-sd", skip_startup_check=True))
    assert set(sd.mixed_sizes.values()) == {"stable-diffusion runs one size a forward"}
