"""Property-based fuzzing of both endpoints on a real server: whatever the body, the answer is
never a 5xx, and every error has the OpenAI shape."""

from __future__ import annotations

import io
import json

import numpy as np
from PIL import Image

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server import LAUNCHES, serves, spec

FIELDS = ["prompt", "model", "n", "size", "response_format", "output_format",
          "output_compression", "user", "seed", "negative_prompt", "num_inference_steps",
          "guidance_scale", "stream", "partial_images", "quality", "background"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
    st.sampled_from(["64x64", "32x32", "128x64", "auto", "0x0", "64x", "x64", "-64x64",
                     "64X64", "1e2x64", "png", "jpeg", "webp", "url", "b64_json", "tiny-sd",
                     "", " ", "\x00", "🙂" * 3]),
    st.sampled_from([0, 1, 2, 3, 10, 11, -1, 100, 2**32, 2**63, 1.5, "1", "2"]),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3),
                   st.dictionaries(st.text(max_size=5), scalars, max_size=2))
plausible = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(min_size=1, max_size=30), values)},
    optional={name: values for name in FIELDS[1:]})
noisy = st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=12)), values, max_size=6)
bodies = st.one_of(
    plausible.map(lambda d: json.dumps(d).encode()),
    noisy.map(lambda d: json.dumps(d).encode()),
    values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.text(max_size=64).map(str.encode),
)


# Small bounds so that the valid bodies the fuzzer finds are cheap to serve.
@pytest.fixture(scope="module")
@serves(spec("--max-inference-steps", "2", "--max-image-side", "64", "--max-n", "2",
             "--max-prompt-chars", "200", "--dynamic-batch-delay-ms", "0",
             "--max-upload-bytes", "100000", "--max-input-pixels", "1000000"))
def server(request):
    with LAUNCHES.take(request) as srv:
        with srv.client(timeout=60) as client:
            yield client


def check(response, n_of) -> None:
    """Not a 5xx; a streamed 200 ends with its completed events; an error has the OpenAI shape."""
    assert response.status_code < 500, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        names = [line.split(": ", 1)[1] for line in response.text.splitlines()
                 if line.startswith("event: ")]
        assert names and all(name.endswith(("partial_image", "completed")) for name in names)
        assert names.count(names[-1]) == n_of() and names[-1].endswith("completed"), names
        return
    payload = response.json()
    if response.status_code == 200:
        assert len(payload["data"]) == n_of()
    else:
        assert set(payload) == {"error"}
        assert set(payload["error"]) == {"message", "type", "param", "code"}
        assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]


def _n(fields) -> int:
    return int(fields.get("n", 1))


@settings(max_examples=1000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_no_body_makes_a_5xx_and_errors_have_the_openai_shape(server, body):
    response = server.post("/v1/images/generations", content=body,
                           headers={"content-type": "application/json"})
    check(response, lambda: _n(json.loads(body)))


def _encoded(fmt: str, size: tuple[int, int], mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((size[1], size[0], len(mode)), 90, np.uint8).squeeze(), mode).save(
        out, format=fmt)
    return out.getvalue()


PNG = _encoded("PNG", (64, 64))
FILES = [PNG, PNG[:40], PNG[:-10], _encoded("JPEG", (64, 64)), _encoded("WEBP", (48, 80)),
         _encoded("GIF", (64, 64), "L"), _encoded("PNG", (16, 16), "L"),
         _encoded("PNG", (64, 64), "RGBA"), _encoded("BMP", (8, 8)), b"", b"\x89PNG\r\n\x1a\n",
         _encoded("PNG", (5000, 5000), "L")]
EDIT_FIELDS = ["prompt", "n", "size", "strength", "seed", "num_inference_steps", "stream",
               "partial_images", "response_format", "output_format", "guidance_scale", "mask",
               "image", "image[]", "model", "quality", "negative_prompt"]
field_values = st.one_of(st.text(max_size=20), st.sampled_from(
    ["1", "2", "0", "-1", "0.5", "1.5", "true", "false", "64x64", "auto", "32x32", "a cat",
     "png", "url", "nan", "1e400", "", "\x00"]))
part = st.one_of(
    st.tuples(st.sampled_from(EDIT_FIELDS + ["x", "", "bad\"name"]), field_values.map(str.encode),
              st.none()),
    st.tuples(st.sampled_from(["image", "image[]", "mask", "prompt", "other"]),
              st.one_of(st.sampled_from(FILES), st.binary(max_size=64)),
              st.sampled_from(["in.png", "x.gif", "", "a\"b.png"])),
)


def multipart(parts, boundary: str, close: bool, prompt: bool) -> bytes:
    if prompt:
        parts = [("prompt", b"a cat", None), ("num_inference_steps", b"2", None), *parts]
    chunks = []
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        chunks.append(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
                      + value + b"\r\n")
    return b"".join(chunks) + (f"--{boundary}--\r\n".encode() if close else b"")


multipart_requests = st.one_of(
    # Well-formed multipart with arbitrary parts and files.
    st.tuples(st.lists(part, max_size=6), st.booleans()).map(
        lambda a: (multipart(a[0], "b0und", True, a[1]), "multipart/form-data; boundary=b0und")),
    # Broken framing: wrong or missing boundary, unterminated body, garbage.
    st.tuples(st.lists(part, max_size=4), st.sampled_from(["b0und", "other", ""]), st.booleans()).map(
        lambda a: (multipart(a[0], "b0und", a[2], True),
                   f"multipart/form-data; boundary={a[1]}" if a[1] else "multipart/form-data")),
    st.tuples(st.binary(max_size=200), st.sampled_from(
        ["multipart/form-data; boundary=b0und", "multipart/form-data", "application/json",
         "text/plain", "multipart/form-data; boundary=\"\""])),
)


@settings(max_examples=1000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(request=multipart_requests)
def test_no_multipart_body_makes_a_5xx_and_errors_have_the_openai_shape(server, request):
    body, content_type = request
    response = server.post("/v1/images/edits", content=body, headers={"content-type": content_type})

    def n_of() -> int:
        text = body.split(b'name="n"\r\n\r\n', 1)
        return int(text[1].split(b"\r\n", 1)[0]) if len(text) > 1 else 1

    check(response, n_of)
