"""Instruction edits served as a user runs them: FLUX.1 Kontext behind ``diffserve serve``, driven
by the official SDK. Concurrent edits share forwards and each equals the plain pipeline called
alone with its fitted input; a generation comes at the size asked for; an edit without a size
takes its input's; what the model does not take is a 400."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from diffserve.executor.model.loading import load_model
from diffserve.frontend.uploads import image_pixels
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, sample_image, solo
from server import LAUNCHES, decode, metric, serves, spec

openai = pytest.importorskip("openai")
MODEL = "tiny-flux-kontext"


@pytest.fixture(scope="module")
@serves(spec("--model", MODEL, "--dynamic-batch-delay-ms", "200"))
def server(request):
    with LAUNCHES.take(request) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, torch_threads=1)


def png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def expected(loaded, prompt: str, seed: int, fitted: np.ndarray, steps: int = 4) -> np.ndarray:
    request = make_request(model=MODEL, task="edit", prompt=prompt, seed=seed, steps=steps,
                           guidance=2.5, width=fitted.shape[1], height=fitted.shape[0],
                           references=1)
    return solo(loaded, {}, request, references=[fitted])[0]


def test_the_model_card_says_what_it_does(client):
    (card,) = client.models.list().data
    assert card.model_extra["tasks"] == ["generate", "edit", "rollout"]
    assert card.model_extra["max_edit_images"] == 1
    assert card.model_extra["schedulers"] == ["flow-euler"]


def test_concurrent_edits_share_forwards_and_each_equals_its_solo_edit(server, client, loaded):
    picture, _ = sample_image(64)
    inputs = [np.ascontiguousarray(np.roll(picture, 7 * i, axis=0)) for i in range(4)]

    def send(i):
        return client.images.edit(image=("in.png", png(inputs[i]), "image/png"),
                                  prompt=f"edit number {i}", extra_body={"seed": 20 + i})

    with server.client() as c:
        before = metric(c.get("/metrics").text, "diffserve_step_running_images_count")
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(send, range(4)))
    for i, result in enumerate(results):
        got = decode(result.data[0].b64_json)
        assert max_diff(got, expected(loaded, f"edit number {i}", 20 + i, inputs[i])) <= 2, i
    with server.client() as c:
        text = c.get("/metrics").text
    forwards = metric(text, "diffserve_step_running_images_count") - before
    rows = metric(text, "diffserve_step_running_images_sum")
    assert forwards < 4 * 4  # fewer forwards than four edits of four steps alone
    assert rows > 0


def test_an_edit_without_a_size_takes_its_inputs_fitted(client, loaded):
    rng = np.random.default_rng(5)
    upload = (rng.random((70, 100, 3)) * 255).astype(np.uint8)  # 100x70: 96x64 at stride 16
    result = client.images.edit(image=("odd.png", png(upload), "image/png"), prompt="tidy it",
                                extra_body={"seed": 9})
    got = decode(result.data[0].b64_json)
    assert got.shape == (64, 96, 3) and result.size == "96x64"
    fitted = image_pixels(Image.fromarray(upload), 96, 64)
    assert max_diff(got, expected(loaded, "tidy it", 9, fitted)) <= 2


def test_a_generation_comes_at_the_size_asked_for(client):
    result = client.images.generate(prompt="a small one", size="64x64", extra_body={"seed": 1})
    assert decode(result.data[0].b64_json).shape == (64, 64, 3)


def test_what_the_model_does_not_take_is_a_400(client):
    image = ("in.png", png(sample_image(64)[0]), "image/png")
    with pytest.raises(openai.BadRequestError, match="takes no strength"):
        client.images.edit(image=image, prompt="x", extra_body={"strength": 0.5})
    with pytest.raises(openai.BadRequestError, match="at most 1"):
        client.images.edit(image=[image, image], prompt="x")
    with pytest.raises(openai.BadRequestError, match="scheduler"):
        client.images.generate(prompt="x", extra_body={"scheduler": "euler"})
