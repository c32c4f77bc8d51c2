"""A request's input frames travel with a manifest in its header: each frame's role, owner and
shape. A control is paired with its own frame by the manifest, wherever the frame lies, and a
message whose frames are not the ones its header declares is refused when it is decoded."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from diffserve.wire.protocol import FramesMismatch, Kind, ProtocolError, decode, encode
from diffserve.wire.samples import CONTROLS, input_arrays, split_inputs
from diffserve.wire.request import (REFERENCES, Control, FrameSpec, Work, WorkItem, frame_manifest,
                            in_manifest_order)
from diffserve.wire.tasks import EDIT
from helpers import make_request

W, H = 32, 16


def solid(value: int, channels: int = 3) -> np.ndarray:
    shape = (H, W, channels) if channels > 1 else (H, W)
    return np.full(shape, value, np.uint8)


def inpaint_with_controls(**fields):
    return make_request(task="inpaint", width=W, height=H,
                        controls=(Control("edges", 0.5), Control("depth", 0.8)), **fields)


def test_the_manifest_lists_the_task_inputs_the_references_and_each_controls_image():
    request = inpaint_with_controls()
    assert [(s.role, s.owner, s.shape) for s in request.manifest] == [
        ("image", 0, (H, W, 3)), ("mask_image", 0, (H, W)),
        (CONTROLS, 0, (H, W, 3)), (CONTROLS, 1, (H, W, 3))]
    assert request.input_frames == 4
    edit = make_request(task="edit", references=2, width=W, height=H)
    assert edit.manifest == frame_manifest(EDIT, W, H, references=2)
    assert [(s.role, s.owner) for s in edit.manifest] == [(REFERENCES, 0), (REFERENCES, 1)]
    assert make_request().manifest == ()


def test_a_control_is_paired_with_its_own_frame_wherever_it_lies():
    request = inpaint_with_controls()
    # The same request with its frames listed in another order: the controls' images first,
    # the second control's before the first's.
    shuffled = dataclasses.replace(request, manifest=tuple(request.manifest[i]
                                                           for i in (3, 2, 1, 0)))
    by_role = {"image": [solid(10)], "mask_image": [solid(255, 1)],
               CONTROLS: [solid(100), solid(200)]}
    for r in (request, shuffled):
        frames = in_manifest_order(r.manifest, by_role)
        kind, decoded, buffers = decode(encode(Kind.SUBMIT, r, [f.tobytes() for f in frames]))
        assert decoded.manifest == r.manifest
        arrays = input_arrays(decoded, [np.frombuffer(b, np.uint8) for b in buffers])
        assert (arrays["image"] == 10).all() and (arrays["mask_image"] == 255).all()
        assert arrays["mask_image"].shape == (H, W)
        for control, image, value in zip(decoded.controls, arrays[CONTROLS], (100, 200)):
            assert (image == value).all(), control  # edges gets 100, depth 200
    assert shuffled.batch_key("request") == request.batch_key("request")  # bookkeeping only


def test_a_manifest_that_is_not_the_frames_the_request_needs_is_refused():
    request = inpaint_with_controls()
    with pytest.raises(ValueError, match="controls\\[1\\]"):
        dataclasses.replace(request, manifest=request.manifest[:3])
    wrong_size = FrameSpec(CONTROLS, 1, (H, W + 8, 3))
    with pytest.raises(ValueError, match="not the frames it needs"):
        dataclasses.replace(request, manifest=(*request.manifest[:3], wrong_size))


@pytest.mark.parametrize("count", [3, 5])
def test_a_request_with_a_missing_or_an_extra_frame_is_refused_at_decode(count):
    request = inpaint_with_controls(request_id="short")
    frames = [solid(1).tobytes(), solid(2, 1).tobytes(), solid(3).tobytes(), solid(4).tobytes(),
              solid(5).tobytes()][:count]
    with pytest.raises(FramesMismatch) as caught:
        decode(encode(Kind.SUBMIT, request, frames))
    error = caught.value
    assert isinstance(error, ProtocolError) and error.kind is Kind.SUBMIT
    assert error.message == request  # the header, so that the request can be answered
    assert str(error) == (f"request 'short' (inpaint) declares 4 input frames (image[0], "
                          f"mask_image[0], controls[0], controls[1]) but carries {count}")


def test_a_frame_of_the_wrong_size_is_refused_at_decode():
    request = inpaint_with_controls(request_id="odd")
    frames = [solid(1), solid(2), solid(3), solid(4)]  # the mask has three channels
    with pytest.raises(FramesMismatch, match=r"input frame 1 \(mask_image\[0\], 16x32 uint8\) "
                       r"holds 1536 bytes, not 512"):
        decode(encode(Kind.SUBMIT, request, frames))


def test_work_carries_each_items_frames_and_a_resumed_item_none():
    edit = make_request(task="image-to-image", width=W, height=H, n=2)
    plain = make_request(width=W, height=H)
    items = [WorkItem(edit, 0, 1), WorkItem(plain, 0, 1), WorkItem(edit, 1, 2, resume=True)]
    work = Work(1, items)
    kind, decoded, buffers = decode(encode(Kind.WORK, work, [solid(7)]))
    assert decoded == work
    assert [len(part) for part in split_inputs(decoded.items, buffers)] == [1, 0, 0]
    with pytest.raises(FramesMismatch, match="work 1 declares 1 input frames"):
        decode(encode(Kind.WORK, work, [solid(7), solid(7)]))
