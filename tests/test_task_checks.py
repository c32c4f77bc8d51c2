"""The start-up checks decide per task, through the server as a user starts it.

The model is SD3's architecture with 4-channel latents (``sd3_four_channels``): generation and
image-to-image run on it, diffusers' SD3 inpainting refuses it. To also have a task the step
engine gets wrong, the real check runs once in this process with SD3's image-to-image start put a
little off; it decides that image-to-image runs in request mode and remembers the verdict in the
session's verdict store, which the server (same model, same code, same settings) recalls at its
start. So the one server serves generation in step mode, image-to-image as request-mode calls
between steps, and refuses inpainting with the reason."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from diffserve.config.flags import ServerConfig
from diffserve.executor.checks import verdicts as check_verdicts
from diffserve.executor.families.sd3.step import StableDiffusion3
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.runtime import build_runtime
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, sample_image, solo
from server import Server, assert_openai_error, decode, metric
from frontend.test_edits_and_streaming import png

SIDE = 64


@pytest.fixture(scope="module")
def server(sd3_four_channels):
    with pytest.MonkeyPatch.context() as patch:
        latents = StableDiffusion3.image_latents
        patch.setattr(StableDiffusion3, "image_latents",
                      lambda self, *args: latents(self, *args) * 1.1)
        # The check runs here (a verdict an earlier server of this code stored is not recalled)
        # and its verdict replaces any stored one.
        recall = check_verdicts.recall
        patch.setattr(check_verdicts, "recall", lambda key, kind="startup-checks": None
                      if kind == "startup-checks" else recall(key, kind))
        rt = build_runtime(ServerConfig(model=str(sd3_four_channels)), torch_threads=1)
    assert rt.info.task_modes == {"generate": "step", "image-to-image": "request",
                                  "rollout": "step"}
    with Server(model=str(sd3_four_channels)) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain(sd3_four_channels):
    loaded = load_model(str(sd3_four_channels), torch_threads=1)
    return loaded, task_pipelines(loaded.pipe)


def test_models_shows_each_tasks_mode_and_what_is_not_served(server):
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["tasks"] == ["generate", "image-to-image", "rollout"]
    assert card["task_modes"] == {"generate": "step", "image-to-image": "request",
                                  "rollout": "step"}
    assert "16 input channels or 33 input channels, not 4" in card["unavailable_tasks"]["inpaint"]
    assert card["batching_mode"] == "step"
    assert "task inpaint is not served: its plain pipeline failed" in server.log


def test_the_unserved_task_is_a_400_naming_it_and_why(server):
    image, mask = sample_image(SIDE)
    with server.client() as c:
        r = c.post("/v1/images/edits", files=[("image", ("in.png", png(image), "image/png")),
                                              ("mask", ("m.png", png(mask), "image/png"))],
                   data={"prompt": "a mask", "num_inference_steps": "2"})
    error = assert_openai_error(r, 400, param="mask", code="unsupported_task")
    assert "does not serve inpaint" in error["message"]
    assert "16 input channels or 33 input channels" in error["message"]


def test_each_task_is_served_in_its_own_mode_and_equals_the_plain_pipeline(server, plain):
    """Generations (step mode) and image-to-image edits (request-mode calls between steps) at
    once: every image equals its plain pipeline alone; the edits ran as pipeline calls, the
    generations as steps."""
    image, _ = sample_image(SIDE, seed=3)
    gens = [make_request(request_id=f"g{i}", seed=20 + i, steps=4 + 2 * i,
                         prompt=f"generation {i}") for i in range(3)]
    edits = [make_request(request_id=f"e{i}", seed=30 + i, steps=4, task="image-to-image",
                          strength=0.75, prompt=f"edit {i}") for i in range(3)]
    before = httpx.get(server.url + "/metrics").text

    def generate(r):
        with server.client() as c:
            return c.post("/v1/images/generations", json={
                "prompt": r.prompt, "seed": r.seed, "num_inference_steps": r.num_inference_steps,
                "guidance_scale": r.guidance_scale, "size": f"{SIDE}x{SIDE}"})

    def edit(r):
        with server.client() as c:
            return c.post("/v1/images/edits", files=[("image", ("in.png", png(image), "image/png"))],
                          data={"prompt": r.prompt, "seed": str(r.seed), "strength": "0.75",
                                "num_inference_steps": "4", "guidance_scale": str(r.guidance_scale),
                                "size": f"{SIDE}x{SIDE}"})

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda job: job[0](job[1]),
                                [(generate, r) for r in gens] + [(edit, r) for r in edits]))
    loaded, pipelines = plain
    for r, answer in zip(gens + edits, answers):
        assert answer.status_code == 200, answer.text
        got = decode(answer.json()["data"][0]["b64_json"])
        want = solo(loaded, pipelines, r, image=image if r.task == "image-to-image" else None)[0]
        assert max_diff(got, want) <= 2, r.request_id
    after = httpx.get(server.url + "/metrics").text
    calls = lambda text: metric(text, "diffserve_batch_execution_seconds_count")  # noqa: E731
    steps = lambda text: metric(text, "diffserve_step_seconds_count")  # noqa: E731
    assert 1 <= calls(after) - calls(before) <= 3  # the edits: pipeline calls
    assert steps(after) - steps(before) >= 8  # the generations: steps, the longest 8 of them
