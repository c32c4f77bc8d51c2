"""ControlNet through the real server (tiny-sd with two control models): /v1/models lists them,
the official SDK sends controls through extra_body, concurrent requests with different controls
(and none) share forwards and each image equals diffusers' ControlNet pipeline alone, an edit takes
its controls as a JSON form field, and every bad control is a 400 naming its field while the
requests beside it are answered exactly."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from diffusers import AutoModel, DiffusionPipeline
from PIL import Image

from diffserve.executor.checks.reference import max_diff, sample_image, solo
from diffserve.builders.registry import resolve_controlnet, resolve_model
from diffserve.wire.request import Control
from helpers import make_request
from server import LAUNCHES, assert_openai_error, decode, metric, serves, spec

GENERATE, EDIT = "/v1/images/generations", "/v1/images/edits"
MODELS = {"edges": "tiny-sd-control", "depth": "tiny-sd-control-b"}


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


# Control images of another size than the requests': the server resizes them as diffusers does.
EDGES = np.zeros((96, 80, 3), np.uint8)
EDGES[24:72, 20:60] = 255
DEPTH = np.repeat(np.linspace(0, 255, 80, dtype=np.uint8)[None, :, None], 96, axis=0).repeat(3, 2)
PICTURES = {"edges": EDGES, "depth": DEPTH}
B64 = {name: base64.b64encode(png(p)).decode() for name, p in PICTURES.items()}


@pytest.fixture(scope="module")
@serves(spec(*(f"--controlnet={n}={p}" for n, p in MODELS.items()), "--batching-mode", "step",
             "--dynamic-batch-max-size", "8", "--dynamic-batch-delay-ms", "50"))
def server(request):
    with LAUNCHES.take(request) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference():
    """The plain pipeline and the control models, in this process, for diffusers' own calls."""
    pipe = DiffusionPipeline.from_pretrained(resolve_model("tiny-sd"))
    pipe.set_progress_bar_config(disable=True)
    return pipe, {n: AutoModel.from_pretrained(resolve_controlnet(p)) for n, p in MODELS.items()}


def expected(reference, controls: list[dict], seed: int, steps: int = 4, **fields):
    pipe, models = reference
    stack = tuple(Control(c["model"], c.get("scale", 1.0), c.get("start", 0.0), c.get("end", 1.0))
                  for c in controls)
    image, mask = fields.pop("inputs", (None, None))
    r = make_request(seed=seed, steps=steps, controls=stack, prompt="a controlled cat", **fields)
    return solo(_Loaded(pipe), {}, r, image=image, mask=mask,
                controls=[(models[c.model], PICTURES[c.model]) for c in stack] or None)[0]


class _Loaded:
    def __init__(self, pipe):
        self.pipe, self.call_kwargs = pipe, {}


def body(controls: list[dict], **fields) -> dict:
    return {"prompt": "a controlled cat", "num_inference_steps": 4, **fields,
            "controls": [{**c, "image": B64[c["model"]]} for c in controls]}


STACKS = [[{"model": "edges", "scale": 0.8}], [], [{"model": "depth", "start": 0.25, "end": 0.75}],
          [{"model": "edges", "scale": 0.5}, {"model": "depth", "scale": 0.7}],
          [{"model": "depth", "scale": 1.3}], [], [{"model": "edges"}, {"model": "edges", "scale": 0.4}],
          [{"model": "edges", "end": 0.5}]]


def post(server, payload) -> httpx.Response:
    with server.client(timeout=120) as c:
        return c.post(GENERATE, json=payload)


def test_models_lists_the_control_models(server):
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert [(m["name"], m["kind"], m["modes"]) for m in card["controls"]] == [
        ("edges", "ControlNetModel", 0), ("depth", "ControlNetModel", 0)]
    assert card["max_controls"] == 4 and all(m["cost"] > 0 for m in card["controls"])
    assert card["task_modes"]["generate+controls"] == "step"


def test_concurrent_requests_share_forwards_and_a_bad_one_disturbs_none(server, reference):
    before = httpx.get(server.url + "/metrics").text
    bad = {**body([{"model": "edges"}]), "seed": 99}
    bad["controls"][0]["image"] = base64.b64encode(png(EDGES)[:40]).decode()  # truncated
    with ThreadPoolExecutor(9) as pool:
        answers = [pool.submit(post, server, {**body(stack), "seed": i})
                   for i, stack in enumerate(STACKS)]
        refused = pool.submit(post, server, bad)
        answers = [a.result() for a in answers]
    assert_openai_error(refused.result(), 400, param="controls[0].image")
    after = httpx.get(server.url + "/metrics").text
    for i, (stack, answer) in enumerate(zip(STACKS, answers)):
        assert answer.status_code == 200, answer.text
        assert max_diff(decode(answer.json()["data"][0]["b64_json"]),
                        expected(reference, stack, i)) <= 2, stack
    forwards = (metric(after, "diffserve_step_running_images_count")
                - metric(before, "diffserve_step_running_images_count"))
    carried = (metric(after, "diffserve_step_running_images_sum")
               - metric(before, "diffserve_step_running_images_sum"))
    assert carried / forwards > 2.0, (carried, forwards)  # they shared denoiser forwards


def test_the_official_sdk_sends_controls_through_extra_body(server, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           _strict_response_validation=True)
    controls = [{"model": "depth", "scale": 0.9, "image": "data:image/png;base64," + B64["depth"]}]
    made = client.images.generate(prompt="a controlled cat", extra_body={
        "seed": 5, "num_inference_steps": 4, "controls": controls})
    want = expected(reference, [{"model": "depth", "scale": 0.9}], 5)
    assert max_diff(decode(made.data[0].b64_json), want) <= 2
    with pytest.raises(openai.BadRequestError, match="no control model 'canny'"):
        client.images.generate(prompt="x", extra_body={"controls": [{**controls[0], "model": "canny"}]})


def test_an_edit_takes_its_controls_as_a_json_form_field(server, reference):
    image, _ = sample_image(64)
    stack = [{"model": "edges", "scale": 0.7}]
    with server.client(timeout=120) as c:
        answer = c.post(EDIT, files={"image": ("in.png", png(image), "image/png")}, data={
            "prompt": "a controlled cat", "seed": "2", "num_inference_steps": "5",
            "strength": "0.6", "controls": f'[{{"model": "edges", "scale": 0.7, "image": "{B64["edges"]}"}}]'})
        bad = c.post(EDIT, files={"image": ("in.png", png(image), "image/png")},
                     data={"prompt": "x", "controls": "not json"})
    assert answer.status_code == 200, answer.text
    want = expected(reference, stack, 2, steps=5, task="image-to-image", strength=0.6,
                    inputs=(image, None))
    assert max_diff(decode(answer.json()["data"][0]["b64_json"]), want) <= 2
    assert_openai_error(bad, 400, param="controls")


@pytest.mark.parametrize("control, param, code", [
    ({"model": "canny"}, "controls[0].model", "control_model_not_found"),
    ({"image": "%%% not base64"}, "controls[0].image", "invalid_image"),
    ({"image": base64.b64encode(b"GIF89a not an image").decode()}, "controls[0].image",
     "invalid_image_format"),
    ({"scale": 11.0}, "controls[0].scale", "invalid_value"),
    ({"start": 0.6, "end": 0.4}, "controls[0].start", "invalid_value"),
    ({"end": 1.5}, "controls[0].end", "invalid_value"),
    ({"mode": 1}, "controls[0].mode", "invalid_value"),
    ({"strength": 1}, "controls[0].strength", "unknown_parameter"),
])
def test_each_bad_control_is_a_400_naming_its_field(server, control, param, code):
    payload = body([{"model": "edges"}])
    payload["controls"][0].update(control)
    assert_openai_error(post(server, payload), 400, param=param, code=code)


def test_too_many_controls_and_images_too_large_are_refused(server):
    assert_openai_error(post(server, body([{"model": "edges"}] * 5)), 400, param="controls",
                        code="too_many_controls")
    payload = body([{"model": "edges"}])  # more pixels than --max-input-pixels (4096 x 4096)
    payload["controls"][0]["image"] = base64.b64encode(png(np.zeros((4200, 4200, 3), np.uint8))).decode()
    assert_openai_error(post(server, payload), 400, param="controls[0].image", code="image_too_large")
    noise = np.random.default_rng(0).integers(0, 256, (700, 700, 3), dtype=np.uint8)
    payload["controls"][0]["image"] = base64.b64encode(png(noise)).decode()
    answer = post(server, payload)  # past --max-body-bytes (1 MiB): the whole body is refused
    assert_openai_error(answer, 413)
    assert "--max-body-bytes" in answer.json()["error"]["message"]
