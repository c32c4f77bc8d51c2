import dataclasses

import numpy as np
import pytest

from diffserve.protocol import (
    PER_SAMPLE,
    SHARED,
    Batch,
    BatchResult,
    GenerationRequest,
    ImageMeta,
    Kind,
    Sample,
    decode,
    encode,
    fields_with_role,
)
from helpers import make_request


def test_every_request_field_declares_its_batching_role():
    roles = {f.name: f.metadata.get("batch") for f in dataclasses.fields(GenerationRequest)}
    assert all(role is not None for role in roles.values()), roles


def test_signature_comes_from_shared_fields_only():
    shared = fields_with_role(GenerationRequest, SHARED)
    assert {"width", "height", "num_inference_steps", "guidance_scale", "model"} <= set(shared)
    assert {"prompt", "negative_prompt", "seed", "n"} <= set(fields_with_role(GenerationRequest, PER_SAMPLE))
    a = make_request(prompt="x", seed=1, n=1)
    b = make_request(prompt="y", seed=2, n=4, negative_prompt="z")
    assert a.batch_signature() == b.batch_signature()
    for change in ({"width": 128}, {"num_inference_steps": 9}, {"guidance_scale": 1.0}, {"model": "m"}):
        assert dataclasses.replace(a, **change).batch_signature() != a.batch_signature()


def test_undeclared_field_is_rejected():
    @dataclasses.dataclass(frozen=True)
    class Bad:
        x: int = 0

    with pytest.raises(TypeError, match="batching role"):
        fields_with_role(Bad, SHARED)


def test_messages_round_trip_with_raw_buffers():
    request = make_request(n=2, seed=7)
    kind, decoded, buffers = decode(encode(Kind.GENERATE, request))
    assert kind is Kind.GENERATE and decoded == request and buffers == []

    batch = Batch(3, request.shared_params(), [Sample(request.request_id, 0, "p", "", 7)])
    assert decode(encode(Kind.BATCH, batch))[1] == batch

    pixels = np.arange(2 * 4 * 3, dtype=np.uint8).reshape(2, 4, 3)
    result = BatchResult(3, 4, 2, 0.5, [ImageMeta(request.request_id, 0, 7)], {})
    frames = encode(Kind.BATCH_RESULT, result, [pixels])
    assert frames[1] is pixels  # the pixel buffer is sent as it is, not serialised
    kind, decoded, buffers = decode([frames[0], pixels.tobytes()])
    assert decoded == result and buffers == [pixels.tobytes()]


def test_every_kind_has_a_payload_type():
    from diffserve.protocol import _PAYLOADS

    assert set(_PAYLOADS) == set(Kind)
