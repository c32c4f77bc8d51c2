import dataclasses

import msgspec
import numpy as np
import pytest

from diffserve.wire.protocol import (
    CALL,
    PAYLOADS,
    REQUEST_MODE,
    SAMPLE,
    MIXED_STEP_MODE,
    SHAPE,
    SIZE,
    STEP_MODE,
    ItemImages,
    ItemResult,
    ItemsDone,
    Kind,
    ProtocolError,
    decode,
    encode,
    fields_with_role,
    batch_key_fields,
)
from diffserve.wire.request import ImageRequest, Work, WorkItem
from helpers import make_request


def test_every_request_field_declares_its_batching_role():
    roles = {f.name: f.metadata.get("batch") for f in dataclasses.fields(ImageRequest)}
    assert all(role is not None for role in roles.values()), roles


def test_the_batch_key_follows_the_mode():
    shape = {"model", "references"}
    assert shape == set(fields_with_role(ImageRequest, SHAPE))
    sizes = {"width", "height", "num_frames"}
    assert sizes == set(fields_with_role(ImageRequest, SIZE))
    call = {"num_inference_steps", "guidance_scale", "strength", "task", "loras", "noise_level",
            "scheduler", "guidance_scale_2", "cache_threshold", "controls"}
    assert call == set(fields_with_role(ImageRequest, CALL))
    assert {"prompt", "negative_prompt", "seed", "n", "returns"} <= set(
        fields_with_role(ImageRequest, SAMPLE))
    assert set(batch_key_fields(ImageRequest, STEP_MODE)) == shape | sizes
    assert set(batch_key_fields(ImageRequest, MIXED_STEP_MODE)) == shape
    assert set(batch_key_fields(ImageRequest, REQUEST_MODE)) == shape | sizes | call
    a = make_request(prompt="x", seed=1, n=1)
    b = make_request(prompt="y", seed=2, n=4, negative_prompt="z", partial_images=2)
    assert a.batch_key(REQUEST_MODE) == b.batch_key(REQUEST_MODE)
    for change in ({"num_inference_steps": 9}, {"guidance_scale": 1.0}, {"task": "image-to-image"},
                   {"loras": (("style", 0.5),)}, {"noise_level": 0.7}):
        changed = dataclasses.replace(a, **change)
        assert changed.batch_key(REQUEST_MODE) != a.batch_key(REQUEST_MODE)
        assert changed.batch_key(STEP_MODE) == a.batch_key(STEP_MODE)
    for change in ({"width": 128}, {"model": "m"}, {"num_frames": 9}):
        assert dataclasses.replace(a, **change).batch_key(STEP_MODE) != a.batch_key(STEP_MODE)
    # Where the step engine mixes sizes, the size and frame count leave the key; the model stays.
    mixed = a.batch_key(MIXED_STEP_MODE)
    assert dataclasses.replace(a, width=128, height=48, num_frames=9).batch_key(
        MIXED_STEP_MODE) == mixed
    for change in ({"model": "m"}, {"references": 1}):
        assert dataclasses.replace(a, **change).batch_key(MIXED_STEP_MODE) != mixed


def test_undeclared_field_is_rejected():
    @dataclasses.dataclass(frozen=True)
    class Bad:
        x: int = 0

    with pytest.raises(TypeError, match="batching role"):
        fields_with_role(Bad, SHAPE)


def test_messages_round_trip_with_raw_buffers():
    request = make_request(n=2, seed=7, task="image-to-image", strength=0.5)
    image = np.zeros((64, 64, 3), np.uint8)
    kind, decoded, buffers = decode(encode(Kind.SUBMIT, request, [image.tobytes()]))
    assert kind is Kind.SUBMIT and decoded == request and buffers == [image.tobytes()]
    assert decoded.input_frames == 1

    work = Work(3, [WorkItem(request, 0, 2)])  # its item's input frame travels with it
    assert decode(encode(Kind.WORK, work, [image.tobytes()]))[1] == work

    done = ItemsDone([ItemResult(request.request_id, 0, 1, "finished", 0.5)])
    assert decode(encode(Kind.ITEMS_DONE, done)) == (Kind.ITEMS_DONE, done, [])

    pixels = np.arange(2 * 4 * 3, dtype=np.uint8).reshape(2, 4, 3)
    images = ItemImages(request.request_id, 0, 1, 4, 2)
    frames = encode(Kind.IMAGES, images, [pixels])
    assert frames[1] is pixels  # the pixel buffer is sent as it is, not serialised
    kind, decoded, buffers = decode([frames[0], pixels.tobytes()])
    assert decoded == images and buffers == [pixels.tobytes()]


def test_seeds_are_consecutive_and_wrap_at_32_bits():
    request = make_request(n=3, seed=2**32 - 2)
    assert [request.seed_of(i) for i in range(3)] == [2**32 - 2, 2**32 - 1, 0]


def test_every_kind_has_a_payload_type():
    assert set(PAYLOADS) == set(Kind)


@pytest.mark.parametrize("frames", [
    [],
    [b""],
    [bytes([99]) + msgspec.msgpack.encode({})],
    [bytes([Kind.SUBMIT]) + b"\xc1garbage"],
    [bytes([Kind.SUBMIT]) + msgspec.msgpack.encode({"request_id": "x"})],  # fields missing
    [bytes([Kind.WORK]) + msgspec.msgpack.encode({"work_id": "one", "items": []})],  # wrong type
    [bytes([Kind.ABORT]) + msgspec.msgpack.encode({"request_id": 5})],
])
def test_a_malformed_message_fails_loudly_at_the_boundary(frames):
    with pytest.raises(ProtocolError):
        decode(frames)


def test_encode_refuses_a_payload_of_the_wrong_type():
    with pytest.raises(ProtocolError):
        encode(Kind.WORK, make_request())
