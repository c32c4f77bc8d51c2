"""Edits and streamed answers through the real server (the trained default model, step mode),
with real HTTP and the official SDK."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.model.loading import load_model
from tools.shapes import data
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, solo
from server import LAUNCHES, assert_openai_error, decode, metric, serves, spec, wait_for_metric

SIZE = data.IMAGE_SIZE
EDITS = "/v1/images/edits"
GENERATIONS = "/v1/images/generations"


def png(image: Image.Image | np.ndarray, fmt: str = "PNG") -> bytes:
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


INPUT = np.asarray(data.draw("red", "circle", "blue", 18, 7, 7))
RIGHT_HALF = np.zeros((SIZE, SIZE), np.uint8)
RIGHT_HALF[:, SIZE // 2:] = 255


def transparent_right_half() -> bytes:
    """OpenAI's mask convention: transparent pixels are the ones to edit."""
    alpha = 255 - RIGHT_HALF
    return png(Image.fromarray(np.dstack([np.zeros((SIZE, SIZE, 3), np.uint8), alpha]), "RGBA"))


@pytest.fixture(scope="module")
@serves(spec("--dynamic-batch-delay-ms", "50", "--max-upload-bytes", str(1 << 20),
             "--max-input-pixels", "1000000", "--max-inference-steps", "1000", model=None))
def server(request):
    with LAUNCHES.take(request) as srv:
        yield srv


@pytest.fixture(scope="module")
def shapes():
    loaded = load_model("shapes", torch_threads=1)
    return loaded, task_pipelines(loaded.pipe)


def edit(server, prompt="a green square on a yellow background", image=None, mask=None,
         timeout=120, **fields):
    files = [("image", ("in.png", image if image is not None else png(INPUT), "image/png"))]
    if mask is not None:
        files.append(("mask", ("mask.png", mask, "image/png")))
    with server.client(timeout=timeout) as c:
        return c.post(EDITS, files=files,
                      data={"prompt": prompt, **{k: str(v) for k, v in fields.items()}})


def test_models_lists_the_tasks(server):
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["tasks"] == ["generate", "image-to-image", "inpaint"]
    assert card["batching_mode"] == "step" and card["partial_images"] is True


def test_concurrent_edits_share_forwards_and_equal_their_solo_edits(server, shapes):
    jobs = [dict(prompt=p, seed=10 + i, strength=s, num_inference_steps=steps)
            for i, (p, s, steps) in enumerate([
                ("a green square on a yellow background", 0.6, 20),
                ("a white triangle on a black background", 0.8, 20),
                ("a purple circle on an orange background", 0.5, 16),
                ("a yellow square on a red background", 0.9, 20),
                ("a blue triangle on a green background", 0.7, 12),
                ("a black circle on a white background", 0.6, 20),
                ("an orange square on a purple background", 0.75, 20),
                ("a red triangle on a green background", 0.65, 18)])]
    inpaint = dict(prompt="a white square on a black background", seed=99, strength=1.0)
    with httpx.Client() as c:
        before = c.get(server.url + "/metrics").text
    with ThreadPoolExecutor(len(jobs) + 1) as pool:
        futures = [pool.submit(edit, server, **job) for job in jobs]
        masked = pool.submit(edit, server, mask=transparent_right_half(), **inpaint)
        responses = [f.result() for f in futures]
        inpainted = masked.result()
    with httpx.Client() as c:
        after = c.get(server.url + "/metrics").text
    assert [r.status_code for r in responses + [inpainted]] == [200] * 9, [r.text for r in responses]
    dispatches = metric(after, "diffserve_dispatches_total") - metric(before, "diffserve_dispatches_total")
    assert dispatches < 9, f"9 edits took {dispatches} dispatches: nothing was batched"
    forwards = (metric(after, "diffserve_step_running_images_count")
                - metric(before, "diffserve_step_running_images_count"))
    carried = (metric(after, "diffserve_step_running_images_sum")
               - metric(before, "diffserve_step_running_images_sum"))
    assert carried / forwards > 1.5, "edits did not share denoising forwards"
    loaded, edits = shapes
    for job, r in zip(jobs + [inpaint], responses + [inpainted]):
        task = "inpaint" if job is inpaint else "image-to-image"
        request = make_request(model="shapes", width=SIZE, height=SIZE, task=task,
                               prompt=job["prompt"], seed=job["seed"], strength=job["strength"],
                               steps=job.get("num_inference_steps", 20), guidance=4.0)
        frames = [INPUT, RIGHT_HALF] if task == "inpaint" else [INPUT]
        expected = solo(loaded, edits, request, *frames)[0]
        got = decode(r.json()["data"][0]["b64_json"])
        assert max_diff(got, expected) <= 2, job


def test_low_strength_stays_closer_to_the_input_than_high(server):
    distance = {}
    for strength in (0.3, 0.95):
        r = edit(server, seed=5, strength=strength)
        image = decode(r.json()["data"][0]["b64_json"]).astype(int)
        distance[strength] = np.abs(image - INPUT.astype(int)).mean()
    # The plain img2img pipeline of this model measures the same: about 92 against 154.
    assert distance[0.3] < 0.8 * distance[0.95], distance


def test_inpainting_keeps_the_pixels_outside_the_mask(server):
    # This 32x32 model decodes a 4x4 latent grid, so colour bleeds across the mask's edge (the
    # plain diffusers inpainting pipeline moves the kept half by 13-47/255 too): "kept" is
    # judged against the repainted half and against the same edit without a mask.
    fields = dict(prompt="a yellow square on a green background", seed=3, strength=1.0)
    masked = decode(edit(server, mask=transparent_right_half(), **fields).json()["data"][0]["b64_json"])
    whole = decode(edit(server, **fields).json()["data"][0]["b64_json"])
    left = slice(0, SIZE // 2 - 2)
    kept = np.abs(masked.astype(int) - INPUT)[:, left].mean()
    repainted = np.abs(masked.astype(int) - INPUT)[:, SIZE // 2 + 2:].mean()
    unmasked = np.abs(whole.astype(int) - INPUT)[:, left].mean()
    assert kept < repainted / 2 and kept < unmasked / 2, (kept, repainted, unmasked)


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    import json

    events = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


@pytest.mark.parametrize("endpoint", ["generate", "edit"])
def test_a_streamed_request_ends_with_the_image_of_the_plain_one(server, endpoint):
    fields = dict(seed=11, num_inference_steps=12, n=2)
    if endpoint == "generate":
        body = {"prompt": "a red square on a white background", **fields}
        with server.client() as c:
            plain = c.post(GENERATIONS, json=body)
            streamed = c.post(GENERATIONS, json={**body, "stream": True, "partial_images": 3})
        prefix = "image_generation"
    else:
        plain = edit(server, strength=0.7, **fields)
        streamed = edit(server, strength=0.7, stream="true", partial_images=3, **fields)
        prefix = "image_edit"
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed)
    partial = [d for name, d in events if name == f"{prefix}.partial_image"]
    completed = [d for name, d in events if name == f"{prefix}.completed"]
    # Three previews per image, each image's in order, then one completed event per image.
    for image_index in (0, 1):
        assert [d["partial_image_index"] for d in partial if d["image_index"] == image_index] == [0, 1, 2]
    assert [d["image_index"] for d in completed] == [0, 1]
    for d in partial + completed:
        assert d["type"].startswith(prefix) and d["size"] == f"{SIZE}x{SIZE}"
        assert {"created_at", "quality", "background", "output_format"} <= set(d)
    assert completed[0]["usage"]["output_tokens"] > 0
    for d, plain_item in zip(completed, plain.json()["data"]):
        assert max_diff(decode(d["b64_json"]), decode(plain_item["b64_json"])) <= 2
    assert max_diff(decode(partial[-1]["b64_json"]), decode(completed[-1]["b64_json"])) > 0


def test_the_official_sdk_in_strict_mode_generates_edits_and_streams_unchanged(server):
    """The SDK that pip resolves today, validating every answer against its own types."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                           _strict_response_validation=True)
    made = client.images.generate(prompt="a red circle on a blue background", n=2,
                                  extra_body={"seed": 3})
    assert [d.model_extra["seed"] for d in made.data] == [3, 4] and made.quality is None
    result = client.images.edit(image=("in.png", png(INPUT), "image/png"), quality="auto",
                                prompt="a green circle on a blue background", n=2,
                                extra_body={"seed": 7, "strength": 0.6})
    assert [d.model_extra["seed"] for d in result.data] == [7, 8]
    assert decode(result.data[0].b64_json).shape == (SIZE, SIZE, 3)
    events = list(client.images.generate(prompt="a red circle on a blue background", stream=True,
                                         partial_images=2, quality="medium", extra_body={"seed": 1}))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + [
        "image_generation.completed"]
    events = list(client.images.edit(image=("in.png", png(INPUT), "image/png"), stream=True,
                                     prompt="a green circle on a blue background", partial_images=1,
                                     mask=("m.png", transparent_right_half(), "image/png")))
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    assert decode(events[-1].b64_json).shape == (SIZE, SIZE, 3)
    with pytest.raises(openai.BadRequestError):
        client.images.edit(image=("in.gif", png(INPUT, "GIF"), "image/gif"), prompt="x")


def test_leaving_a_stream_cancels_the_request_at_once(server):
    text = httpx.get(server.url + "/metrics").text
    cancelled = metric(text, "diffserve_step_retirements_total", outcome="cancelled")
    previews = metric(text, "diffserve_partial_images_total")
    body = {"prompt": "a slow one", "num_inference_steps": 800, "stream": True,
            "partial_images": 3, "seed": 1}
    with server.client(timeout=120) as c:
        with c.stream("POST", GENERATIONS, json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("event: image_generation.partial_image"):
                    break  # one preview seen; the client hangs up mid-stream
    wait_for_metric(server, "diffserve_step_retirements_total", lambda v: v > cancelled,
                    outcome="cancelled")
    # Dropped at once, not when the next preview (200 steps later) would have been written.
    assert metric(httpx.get(server.url + "/metrics").text, "diffserve_partial_images_total") == previews + 1


def bomb() -> bytes:
    """A 20000 x 20000 PNG of one colour: a few kilobytes on the wire, 1.2 GB decoded."""
    return png(Image.new("L", (20_000, 20_000)))


@pytest.mark.parametrize("case, status, param, code", [
    ("gif", 400, "image", "invalid_image_format"),
    ("not an image", 400, "image", "invalid_image_format"),
    ("truncated", 400, "image", "invalid_image"),
    ("empty", 400, "image", "invalid_image"),
    ("bomb", 400, "image", "image_too_large"),
    ("mask of another size", 400, "mask", "invalid_mask"),
    ("two images", 400, "image", "invalid_value"),
    ("no image", 400, "image", "missing_required_parameter"),
    ("too large", 413, None, "request_too_large"),
    ("json body without images", 400, "images", "missing_required_parameter"),
    ("text body", 400, None, "invalid_content_type"),
    ("unterminated", 400, None, "invalid_multipart"),
    ("unknown field", 400, "colour", "unknown_parameter"),
    ("bad strength", 400, "strength", "invalid_value"),
    ("no steps left", 400, "strength", "invalid_value"),
])
def test_bad_uploads_get_a_clear_400(server, case, status, param, code):
    image = png(INPUT)
    files = [("image", ("in.png", image, "image/png"))]
    fields = {"prompt": "a cat"}
    content = None
    if case == "gif":
        files = [("image", ("in.gif", png(INPUT, "GIF"), "image/gif"))]
    elif case == "not an image":
        files = [("image", ("in.png", b"hello, world" * 10, "image/png"))]
    elif case == "truncated":
        files = [("image", ("in.png", image[: len(image) // 2], "image/png"))]
    elif case == "empty":
        files = [("image", ("in.png", b"", "image/png"))]
    elif case == "bomb":
        files = [("image", ("in.png", bomb(), "image/png"))]
    elif case == "mask of another size":
        files.append(("mask", ("m.png", png(Image.new("L", (16, 16))), "image/png")))
    elif case == "two images":
        files = [("image[]", ("a.png", image, "image/png")), ("image[]", ("b.png", image, "image/png"))]
    elif case == "no image":
        files = [("n", (None, "1"))]  # a multipart form with text fields only
    elif case == "too large":
        files = [("image", ("in.png", b"\x89PNG" + b"0" * (1 << 20), "image/png"))]
    elif case in ("json body without images", "text body"):
        content = b'{"prompt": "a cat"}'
    elif case == "unterminated":  # the last field (n=2) has no closing boundary after it
        content = (b'--b0und\r\nContent-Disposition: form-data; name="image"; filename="in.png"\r\n\r\n'
                   + image + b'\r\n--b0und\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n'
                   b'a cat\r\n--b0und\r\nContent-Disposition: form-data; name="n"\r\n\r\n2\r\n')
    elif case == "unknown field":
        fields["colour"] = "red"
    elif case == "bad strength":
        fields["strength"] = "1.5"
    elif case == "no steps left":
        fields.update(strength="0.01", num_inference_steps="20")
    with server.client() as c:
        before = metric(c.get("/metrics").text, "diffserve_dispatches_total")
        if content is not None:
            kind = {"unterminated": "multipart/form-data; boundary=b0und",
                    "text body": "text/plain"}.get(case, "application/json")
            r = c.post(EDITS, content=content, headers={"content-type": kind})
        else:
            r = c.post(EDITS, files=files, data=fields)
        assert_openai_error(r, status, param, code)
        assert metric(c.get("/metrics").text, "diffserve_dispatches_total") == before


def test_the_image_is_fitted_to_the_requested_size(server):
    wide = Image.fromarray(np.tile(INPUT, (1, 2, 1)))  # 64 x 32
    r = edit(server, image=png(wide), size="32x32", seed=1, strength=0.3)
    assert r.status_code == 200, r.text
    assert decode(r.json()["data"][0]["b64_json"]).shape == (SIZE, SIZE, 3)


@pytest.mark.server("--model", "tiny-hunyuandit")
def test_a_model_without_task_pipelines_answers_400(own_server):
    with own_server as srv:
        card = httpx.get(srv.url + "/v1/models").json()["data"][0]
        assert card["tasks"] == ["generate"] and card["batching_mode"] == "request"
        assert card["partial_images"] is False
        r = edit(srv, prompt="x")
        assert_openai_error(r, 400, "image", "unsupported_task")
