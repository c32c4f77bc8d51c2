"""The OpenAI images API as its official SDK uses it, through one real server: every parameter
of generations and edits, JSON edits, and values the server cannot honour refused by name."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from helpers import image_host
from server import LAUNCHES, assert_openai_error, decode, serves, spec

SIZE = 64
KEY, TTL_S = "test-key", 4
EDITS = "/v1/images/edits"
GENERATIONS = "/v1/images/generations"


@pytest.fixture(scope="module")
@serves(spec("--dynamic-batch-delay-ms", "20", "--allowed-image-hosts", "127.0.0.1",
             "--api-key", KEY, "--image-ttl-s", str(TTL_S)))
def server(request):
    with LAUNCHES.take(request) as srv:
        yield srv


def png(seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def client(server):
    return server.client(headers={"Authorization": f"Bearer {KEY}"})


def strict_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY,
                         _strict_response_validation=True)


EVERY_PARAMETER = dict(background="opaque", moderation="low", n=1, output_compression=80,
                       output_format="webp", partial_images=1, quality="high",
                       response_format="b64_json", safety_identifier="user-hash", size="64x64",
                       style="natural", user="someone", complexity="low", model="tiny-sd")
# The SDK's edit takes neither moderation nor style.
EDIT_PARAMETERS = {k: v for k, v in EVERY_PARAMETER.items() if k not in ("moderation", "style")}


def test_the_sdk_in_strict_mode_generates_and_edits_with_every_parameter(server):
    client = strict_client(server)
    made = client.images.generate(prompt="a red circle", extra_body={"seed": 3,
                                  "num_inference_steps": 2}, **EVERY_PARAMETER)
    assert made.output_format == "webp" and made.quality is None
    assert made.safety_identifier == "user-hash" and made.background == "opaque"
    assert Image.open(io.BytesIO(base64.b64decode(made.data[0].b64_json))).format == "WEBP"
    edited = client.images.edit(image=("in.png", png(), "image/png"), prompt="a blue square",
                                input_fidelity="high", extra_body={"seed": 1,
                                "num_inference_steps": 2}, **EDIT_PARAMETERS)
    assert edited.output_format == "webp" and len(edited.data) == 1
    streamed = list(client.images.generate(prompt="a red circle", stream=True, moderation="auto",
                                           quality="auto", style="vivid", partial_images=0,
                                           extra_body={"num_inference_steps": 2}))
    assert streamed[-1].type == "image_generation.completed"


@pytest.mark.parametrize("fields, param, value", [
    ({"background": "transparent"}, "background", "transparent"),
    ({"output_format": "gif"}, "output_format", "gif"),
    ({"output_format": "svg"}, "output_format", "svg"),
    ({"frame_count": 4}, "frame_count", "4"),
    ({"moderation": "off"}, "moderation", "off")])
def test_a_value_the_server_cannot_honour_is_a_400_naming_it(server, fields, param, value):
    with client(server) as c:
        error = assert_openai_error(c.post(GENERATIONS, json={"prompt": "x", **fields}), 400,
                                    param)
    assert repr(value) in error["message"]
    with pytest.raises(openai.BadRequestError):
        strict_client(server).images.generate(prompt="x", background="transparent")


def test_an_edit_asking_for_svg_output_is_refused_by_name(server):
    with client(server) as c:
        r = c.post(EDITS, files={"image": ("in.png", png(), "image/png")},
                   data={"prompt": "x", "svg[model]": "author"})
        assert_openai_error(r, 400, "svg", "unsupported_value")
        r = c.post(EDITS, files={"image": ("in.png", png(), "image/png"),
                                 "markup": ("m.png", png(), "image/png")}, data={"prompt": "x"})
        assert_openai_error(r, 400, "markup", "unsupported_value")


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


EDIT_FIELDS = {"prompt": "a blue square", "seed": 11, "num_inference_steps": 2, "strength": 0.7}


def test_a_json_edit_equals_the_same_multipart_edit(server):
    with client(server) as c:
        multipart = c.post(EDITS, files={"image": ("in.png", png(5), "image/png")},
                           data={k: str(v) for k, v in EDIT_FIELDS.items()})
        assert multipart.status_code == 200, multipart.text
        by_data = c.post(EDITS, json={**EDIT_FIELDS, "images": [{"image_url": data_url(png(5))}]})
        assert by_data.status_code == 200, by_data.text
        with image_host(body=png(5)) as url:
            by_url = c.post(EDITS, json={**EDIT_FIELDS, "images": [{"image_url": url}]})
        assert by_url.status_code == 200, by_url.text
    expected = decode(multipart.json()["data"][0]["b64_json"])
    for answer in (by_data, by_url):
        assert np.array_equal(decode(answer.json()["data"][0]["b64_json"]), expected)


@pytest.mark.parametrize("images, param, code", [
    ([{"image_url": "http://localhost:9/in.png"}], "images[0].image_url", "image_url_not_allowed"),
    ([{"image_url": "file:///etc/passwd"}], "images[0].image_url", "invalid_image_url"),
    ([{"image_url": "data:image/png,abc"}], "images[0].image_url", "invalid_image_url"),
    ([{"image_url": "data:image/png;base64,!!"}], "images[0].image_url", "invalid_image_url"),
    ([{"file_id": "file-1"}], "images[0].file_id", "unsupported_parameter"),
    ([], "images", None),
    ([{"image_url": "data:image/png;base64,aGVsbG8="}], "image", "invalid_image_format")])
def test_a_json_edit_with_a_bad_image_is_a_400(server, images, param, code):
    with client(server) as c:
        r = c.post(EDITS, json={"prompt": "x", "images": images})
    assert_openai_error(r, 400, param, code)


def test_an_image_host_that_fails_is_a_400(server):
    with image_host(404, b"gone") as url, client(server) as c:
        r = c.post(EDITS, json={"prompt": "x", "images": [{"image_url": url}]})
    assert_openai_error(r, 400, "images[0].image_url", "image_url_unreachable")


def test_a_url_result_is_fetched_with_the_key_and_gone_after_its_expiry(server):
    sdk = strict_client(server)
    body = dict(prompt="a red circle", n=2, size="64x64", output_format="jpeg",
                extra_body={"seed": 9, "num_inference_steps": 2})
    by_url = sdk.images.generate(response_format="url", **body)
    inline = sdk.images.generate(**body)
    assert [d.b64_json for d in by_url.data] == [None, None]
    urls = [d.url for d in by_url.data]
    assert all(u.startswith(server.url + "/v1/images/img_") for u in urls)
    with client(server) as c:
        for url, same in zip(urls, inline.data):
            got = c.get(url)
            assert got.status_code == 200 and got.headers["content-type"] == "image/jpeg"
            assert got.content == base64.b64decode(same.b64_json)
        fetched = sdk.get(urls[0], cast_to=httpx.Response).content  # the SDK sends the key
        assert fetched == base64.b64decode(inline.data[0].b64_json)
        with server.client() as anonymous:
            assert_openai_error(anonymous.get(urls[0]), 401)
        time.sleep(TTL_S + 0.5)
        assert_openai_error(c.get(urls[0]), 404, code="image_not_found")
        assert_openai_error(c.get("/v1/images/img_nope/content"), 404)
        r = c.post(GENERATIONS, json={"prompt": "x", "response_format": "url", "stream": True})
        assert_openai_error(r, 400, "response_format", "unsupported_value")
