"""Every parameter of the OpenAI images API, in place: the SDK's own parameter sets are accepted
by the bodies, null means the default, and a value the server cannot honour is a 400 naming the
value."""

from __future__ import annotations

import typing

import pytest
from openai.types import image_edit_params, image_generate_params

from diffserve.errors import APIError
from diffserve.frontend.bodies import validate
from diffserve.frontend.compat import check_form_fields, check_served
from diffserve.frontend.schemas import ImageEditForm, ImageGenerationRequest


def sdk_params(params: type) -> set[str]:
    return set(typing.get_type_hints(params))


def test_the_bodies_take_every_parameter_the_sdk_sends():
    generate = sdk_params(image_generate_params.ImageGenerateParamsNonStreaming)
    edit = sdk_params(image_edit_params.ImageEditParamsNonStreaming)
    assert generate - set(ImageGenerationRequest.model_fields) == set()
    # The files (image, mask, markup) come as multipart parts, read apart from the fields.
    assert edit - set(ImageEditForm.model_fields) == {"image", "mask", "markup"}


def literal_values(params: type, name: str) -> list:
    hint = typing.get_type_hints(params)[name]
    found = []
    for arg in typing.get_args(hint) or (hint,):
        found += [a for a in typing.get_args(arg)] if typing.get_origin(arg) is typing.Literal else []
    if typing.get_origin(hint) is typing.Literal:
        found += list(typing.get_args(hint))
    return found


UNSERVED = {("background", "transparent"), ("output_format", "gif"), ("output_format", "svg")}


@pytest.mark.parametrize("name", ["background", "moderation", "output_format", "quality",
                                  "response_format", "style", "complexity"])
def test_every_value_of_the_sdk_is_accepted_or_refused_by_value(name):
    values = literal_values(image_generate_params.ImageGenerateParamsNonStreaming, name)
    assert values
    for value in values:
        body = validate(ImageGenerationRequest, {"prompt": "x", name: value})
        if (name, value) in UNSERVED:
            with pytest.raises(APIError) as error:
                check_served(body)
            assert (error.value.status, error.value.param) == (400, name)
            assert repr(value) in error.value.message
        else:
            check_served(body)


def test_edits_take_input_fidelity_as_form_text():
    for value in literal_values(image_edit_params.ImageEditParamsNonStreaming, "input_fidelity"):
        body = validate(ImageEditForm, {"prompt": "x", "input_fidelity": value, "n": "2"})
        assert body.input_fidelity == value and body.n == 2


def test_null_is_the_default():
    body = validate(ImageGenerationRequest, {"prompt": "x", "n": None, "quality": None,
                                             "output_format": None, "stream": None,
                                             "moderation": None, "partial_images": None})
    assert (body.n, body.quality, body.output_format, body.stream) == (1, "auto", "png", False)


@pytest.mark.parametrize("fields, param", [
    ({"frame_count": 4}, "frame_count"), ({"frame_duration_ms": 100}, "frame_duration_ms"),
    ({"svg": {"model": "m"}}, "svg")])
def test_gif_and_svg_settings_are_refused(fields, param):
    with pytest.raises(APIError) as error:
        check_served(validate(ImageGenerationRequest, {"prompt": "x", **fields}))
    assert (error.value.status, error.value.param, error.value.code) == (400, param,
                                                                          "unsupported_value")


def test_a_value_outside_the_set_is_named():
    with pytest.raises(APIError) as error:
        validate(ImageGenerationRequest, {"prompt": "x", "moderation": "strict"})
    assert error.value.param == "moderation" and "'strict'" in error.value.message


def test_form_parts_for_svg_output_are_refused():
    with pytest.raises(APIError) as error:
        check_form_fields({"svg[model]": "m"}, {})
    assert error.value.param == "svg"
    with pytest.raises(APIError) as error:
        check_form_fields({}, {"markup": [b"<svg/>"]})
    assert error.value.param == "markup"
    check_form_fields({"prompt": "x"}, {"image": [b"png"]})
