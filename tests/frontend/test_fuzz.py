"""Property-based fuzzing of the generation endpoint on a real server: whatever the body, the
answer is never a 5xx, and every error has the OpenAI shape."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server import Server

FIELDS = ["prompt", "model", "n", "size", "response_format", "output_format",
          "output_compression", "user", "seed", "negative_prompt", "num_inference_steps",
          "guidance_scale"]

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


@pytest.fixture(scope="module")
def server():
    # Small bounds so that the valid bodies the fuzzer finds are cheap to serve.
    with Server("--max-inference-steps", "2", "--max-image-side", "64", "--max-n", "2",
                "--max-prompt-chars", "200", "--dynamic-batch-delay-ms", "0") as srv:
        with srv.client(timeout=60) as client:
            yield client


@settings(max_examples=1000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_no_body_makes_a_5xx_and_errors_have_the_openai_shape(server, body):
    response = server.post("/v1/images/generations", content=body,
                           headers={"content-type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    payload = response.json()
    if response.status_code == 200:
        data = json.loads(body)
        assert len(payload["data"]) == data.get("n", 1)
    else:
        assert set(payload) == {"error"}
        assert set(payload["error"]) == {"message", "type", "param", "code"}
        assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]
