"""FLUX.1 Fill served as a user runs it: ``/v1/images/edits`` through the official SDK with an
image and a mask (inpainting; outpainting by a mask, or by the image's own transparent border,
whose transparent pixels are the ones to redraw). Concurrent edits share forwards and each equals
``FluxFillPipeline`` called alone with the fitted image and mask; a bad or missing mask is a 400
naming ``mask``."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from diffserve.executor.checks.reference import max_diff, sample_image, solo
from diffserve.executor.model.loading import load_model
from diffserve.frontend.uploads import image_pixels, mask_pixels
from helpers import make_request
from server import LAUNCHES, assert_openai_error, decode, metric, serves, spec

openai = pytest.importorskip("openai")
MODEL = "tiny-flux-fill"


@pytest.fixture(scope="module")
@serves(spec("--model", MODEL, "--dynamic-batch-delay-ms", "200"))
def server(request):
    with LAUNCHES.take(request) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def png(image) -> bytes:
    out = io.BytesIO()
    (Image.fromarray(image) if isinstance(image, np.ndarray) else image).save(out, format="PNG")
    return out.getvalue()


def framed(picture: np.ndarray, border: int) -> Image.Image:
    """Outpainting's input: the picture shrunk into the middle, a transparent border around it."""
    size = picture.shape[0]
    inner = Image.fromarray(picture).resize((size - 2 * border,) * 2).convert("RGBA")
    canvas = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    canvas.paste(inner, (border, border))
    return canvas


def test_the_model_card_says_it_only_inpaints(client):
    (card,) = client.models.list().data
    assert card.model_extra["tasks"] == ["inpaint"]


def test_concurrent_fills_share_forwards_and_each_equals_the_pipeline_alone(server, client):
    picture, mask = sample_image(64)
    other, _ = sample_image(64, seed=2)
    bordered = framed(other, 12)
    alpha_mask = bordered.copy()  # OpenAI's convention: transparent pixels are redrawn
    jobs = [  # (image, mask or None, prompt, seed, strength)
        (Image.fromarray(picture), Image.fromarray(mask), "a red circle", 1, 1.0),
        (Image.fromarray(other), Image.fromarray(255 - mask), "a blue square", 2, 0.75),
        (bordered.convert("RGB"), alpha_mask, "the landscape around it", 3, 1.0),
        (bordered, None, "the same, the border from the image's alpha", 4, 1.0),
    ]

    def send(job):
        image, m, prompt, seed, strength = job
        extra = {"seed": seed, "strength": strength, "num_inference_steps": 4}
        return client.images.edit(image=("in.png", png(image), "image/png"), prompt=prompt,
                                  **({"mask": ("m.png", png(m), "image/png")} if m else {}),
                                  extra_body=extra)

    with server.client() as c:
        before = c.get("/metrics").text
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(send, jobs))
    with server.client() as c:
        after = c.get("/metrics").text
    forwards = (metric(after, "diffserve_step_running_images_count")
                - metric(before, "diffserve_step_running_images_count"))
    rows = (metric(after, "diffserve_step_running_images_sum")
            - metric(before, "diffserve_step_running_images_sum"))
    assert rows / forwards > 1, "the fills did not share forwards"
    loaded = load_model(MODEL, torch_threads=1)
    for (image, m, prompt, seed, strength), result in zip(jobs, results):
        request = make_request(model=MODEL, task="inpaint", prompt=prompt, seed=seed,
                               strength=strength, steps=4, guidance=30.0)
        fitted = image_pixels(image, 64, 64)
        fitted_mask = mask_pixels(m if m is not None else image, image, 64, 64)
        expected = solo(loaded, {}, request, fitted, fitted_mask)[0]
        assert max_diff(decode(result.data[0].b64_json), expected) <= 2, prompt


def test_a_bad_or_missing_mask_is_a_400_naming_it(server):
    picture, mask = sample_image(64)

    def edit(files):
        with server.client() as c:
            return c.post("/v1/images/edits", data={"prompt": "x"},
                          files=[(k, (f"{k}.png", v, "image/png")) for k, v in files])

    small = png(np.ascontiguousarray(mask[::2, ::2]))
    assert_openai_error(edit([("image", png(picture)), ("mask", small)]), 400, "mask",
                        "invalid_mask")
    # No mask, and an image without transparency: nothing says what to redraw.
    error = assert_openai_error(edit([("image", png(picture))]), 400, "mask")
    assert "only inpaints" in error["message"]


def test_a_json_edit_with_a_mask_equals_the_multipart_edit(server):
    """OpenAI's JSON edits: the image and the mask as data URLs, the same edit as multipart."""
    import base64

    picture, mask = sample_image(64)
    fields = {"prompt": "a red circle", "seed": 5, "strength": 1.0, "num_inference_steps": 4}

    def url(image) -> str:
        return "data:image/png;base64," + base64.b64encode(png(image)).decode()

    with server.client() as c:
        multipart = c.post("/v1/images/edits", data={k: str(v) for k, v in fields.items()},
                           files=[("image", ("in.png", png(picture), "image/png")),
                                  ("mask", ("m.png", png(mask), "image/png"))])
        as_json = c.post("/v1/images/edits", json={**fields, "images": [{"image_url": url(picture)}],
                                                   "mask": {"image_url": url(mask)}})
    assert multipart.status_code == as_json.status_code == 200, (multipart.text, as_json.text)
    assert max_diff(decode(as_json.json()["data"][0]["b64_json"]),
                    decode(multipart.json()["data"][0]["b64_json"])) == 0
