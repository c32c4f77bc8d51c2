"""Model- and config-aware request checks, in place."""

import pytest
from pydantic import ValidationError

from diffserve.config.flags import ServerConfig
from diffserve.errors import APIError
from diffserve.frontend.schemas import ImageGenerationRequest
from diffserve.frontend.spec import edit_spec, generation_spec
from diffserve.frontend.validation import to_engine_request
from diffserve.wire.model_info import ModelInfo
from diffserve.wire.tasks import GENERATE, TASKS

INFO = ModelInfo(name="tiny-sd", pipeline_class="StableDiffusionPipeline", width=64, height=64,
                 spatial_stride=8, default_steps=4, max_steps=999, default_guidance_scale=5.0,
                 supports_negative_prompt=True, device="cpu", dtype="float32",
                 batching_mode="step", tasks=["generate", "image-to-image"], partial_images=True)


def convert(config=None, info=INFO, **fields):
    body = ImageGenerationRequest(**{"prompt": "a cat", **fields})
    return to_engine_request(generation_spec(body), "rid", info, config or ServerConfig(),
                             GENERATE)


def test_defaults_come_from_the_model():
    r = convert(seed=3)
    assert (r.width, r.height, r.num_inference_steps, r.guidance_scale, r.seed, r.n) == (64, 64, 4, 5.0, 3, 1)
    assert r.model == "tiny-sd" and r.negative_prompt == ""


def test_server_draws_a_seed_when_none_is_given():
    seeds = {convert().seed for _ in range(20)}
    assert len(seeds) > 1


def test_the_largest_seed_is_accepted_and_its_images_wrap():
    r = convert(seed=2**32 - 1, n=3)
    assert [r.seed_of(i) for i in range(3)] == [2**32 - 1, 0, 1]
    with pytest.raises(ValidationError, match="seed"):  # the route turns it into a 400 naming it
        convert(seed=2**32)


@pytest.mark.parametrize("fields, param, status", [
    ({"model": "other"}, "model", 404),
    ({"size": "68x64"}, "size", 400),
    ({"size": "64x64x3"}, "size", 400),
    ({"size": "4096x64"}, "size", 400),
    ({"n": 11}, "n", 400),
    ({"num_inference_steps": 201}, "num_inference_steps", 400),
    ({"response_format": "url", "stream": True}, "response_format", 400),
    ({"prompt": " \n\t"}, "prompt", 400),
    ({"prompt": "a\x00b"}, "prompt", 400),
    ({"negative_prompt": "x" * 4001}, "negative_prompt", 400),
])
def test_violations_name_the_parameter(fields, param, status):
    with pytest.raises(APIError) as error:
        convert(**fields)
    assert (error.value.param, error.value.status) == (param, status)


def test_steps_are_bounded_by_the_model_schedule_too():
    config = ServerConfig(max_inference_steps=5000)
    assert convert(config, num_inference_steps=999).num_inference_steps == 999
    with pytest.raises(APIError, match="limit of 999"):
        convert(config, num_inference_steps=1000)


def test_pixel_budget_and_side_limit_are_configurable():
    config = ServerConfig(max_image_side=256, max_image_pixels=128 * 128)
    assert convert(config, size="128x128").width == 128
    with pytest.raises(APIError, match="at most 16384 pixels"):
        convert(config, size="256x128")


def test_negative_prompt_refused_when_the_pipeline_takes_none():
    info = ModelInfo(**{**INFO.__dict__, "supports_negative_prompt": False})
    with pytest.raises(APIError) as error:
        convert(info=info, negative_prompt="blurry")
    assert error.value.param == "negative_prompt"


def edit(info=INFO, task="image-to-image", **fields):
    from diffserve.frontend.schemas import ImageEditForm

    body = ImageEditForm.model_validate({"prompt": "make it blue", **fields})
    return to_engine_request(edit_spec(body), "rid", info, ServerConfig(), TASKS[task])


def test_form_fields_arrive_as_strings_and_are_converted():
    r = edit(n="2", strength="0.5", seed="9", num_inference_steps="10", stream="true",
             partial_images="2", guidance_scale="3.5")
    assert (r.task, r.n, r.strength, r.seed, r.num_inference_steps, r.partial_images) == (
        "image-to-image", 2, 0.5, 9, 10, 2)


def test_an_edit_the_model_cannot_do_is_a_clear_400():
    with pytest.raises(APIError) as error:
        edit(task="inpaint")
    assert error.value.status == 400 and error.value.code == "unsupported_task"
    assert error.value.param == "mask" and "inpaint" in error.value.message


def test_strength_that_leaves_no_step_is_refused():
    with pytest.raises(APIError) as error:
        edit(strength="0.1", num_inference_steps="4")
    assert error.value.param == "strength"


def test_previews_are_only_made_for_a_stream():
    assert convert(partial_images=3).partial_images == 0
    assert convert(partial_images=3, stream=True).partial_images == 3


CONTROL = {"model": "edges", "image": "aGk="}


def test_controls_on_a_family_without_controlnet_are_refused():
    with pytest.raises(APIError, match="takes no controls") as refused:
        convert(controls=[CONTROL])
    assert (refused.value.status, refused.value.param) == (400, "controls")


def test_controls_where_no_control_model_is_served_are_refused():
    from diffserve.wire.model_info import ControlModelInfo

    info = ModelInfo(**{**INFO.__dict__, "controls_supported": True})
    with pytest.raises(APIError, match="serves no control model"):
        convert(info=info, controls=[CONTROL])
    served = ModelInfo(**{**info.__dict__, "control_models": [ControlModelInfo("edges", "ControlNetModel", 0, 0.5)],
                          "task_modes": {"generate": "step", "generate+controls": "step"}})
    r = convert(info=served, controls=[{**CONTROL, "scale": 0.5}], n=2)
    assert r.controls[0].scale == 0.5 and r.cost == pytest.approx(2 * 1.5)  # with guidance
    assert r.input_frames == 1 and r.mode_key == "generate+controls"
