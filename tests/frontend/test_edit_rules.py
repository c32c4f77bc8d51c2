"""The rules of edits by instruction and of per-request samplers, in place: what a model without
strength refuses, how many images an edit takes, the default size of an edit, a generation on an
edit-only model, an unknown sampler."""

from __future__ import annotations

import dataclasses

import pytest

from diffserve.config.flags import ServerConfig
from diffserve.errors import APIError
from diffserve.frontend.schemas import ImageEditForm, ImageGenerationRequest
from diffserve.frontend.spec import edit_spec, generation_spec
from diffserve.frontend.validation import fitted_size, to_engine_request
from diffserve.wire.model_info import ModelInfo
from diffserve.wire.tasks import EDIT, GENERATE, IMAGE_TO_IMAGE

KONTEXT = ModelInfo(name="kontext", pipeline_class="FluxKontextPipeline", width=64, height=64,
                    spatial_stride=16, default_steps=4, max_steps=1000, default_guidance_scale=2.5,
                    supports_negative_prompt=True, device="cpu", dtype="float32",
                    batching_mode="step", tasks=["generate", "edit"], partial_images=True,
                    max_edit_images=1, schedulers=["flow-euler"], guidance_rule="never")
EDIT_ONLY = dataclasses.replace(KONTEXT, name="qwen-edit", pipeline_class="QwenImageEditPlusPipeline",
                                tasks=["edit"], max_edit_images=3, guidance_rule="with_negative")
SD = dataclasses.replace(KONTEXT, name="sd", pipeline_class="StableDiffusionPipeline",
                         spatial_stride=8, tasks=["generate", "image-to-image", "inpaint"],
                         schedulers=["ddim", "euler"], guidance_rule="above_one")


def edit(info, references=1, default_size=None, **fields):
    body = ImageEditForm(**{"prompt": "make it red", **fields})
    task = EDIT if EDIT.name in info.tasks else IMAGE_TO_IMAGE
    return to_engine_request(edit_spec(body), "rid", info, ServerConfig(), task, (), references,
                             default_size)


def error_of(call) -> APIError:
    with pytest.raises(APIError) as caught:
        call()
    return caught.value


def test_an_instruction_edit_takes_no_strength_and_a_redrawing_one_defaults_it():
    e = error_of(lambda: edit(KONTEXT, strength="0.5"))
    assert (e.status, e.param) == (400, "strength") and "takes no strength" in e.message
    r = edit(KONTEXT)
    assert (r.task, r.references, r.strength) == ("edit", 1, 1.0)
    assert edit(SD).strength == 0.8 and edit(SD, strength="0.3").strength == 0.3


def test_an_edit_takes_up_to_the_models_images_and_the_message_names_the_limit():
    assert edit(EDIT_ONLY, references=3).references == 3
    e = error_of(lambda: edit(EDIT_ONLY, references=4))
    assert (e.status, e.param) == (400, "image") and "at most 3" in e.message
    assert "at most 1" in error_of(lambda: edit(KONTEXT, references=2)).message


def test_a_generation_on_an_edit_only_model_names_the_edits_endpoint():
    body = ImageGenerationRequest(prompt="a cat")
    e = error_of(lambda: to_engine_request(generation_spec(body), "rid", EDIT_ONLY,
                                           ServerConfig(), GENERATE))
    assert (e.status, e.code) == (400, "unsupported_task") and "/v1/images/edits" in e.message


def test_an_edit_without_a_size_takes_the_first_inputs_fitted_to_the_model():
    config = ServerConfig(max_image_side=512, max_image_pixels=512 * 512)
    assert fitted_size(100, 70, KONTEXT, config) == (96, 64)  # down to the stride
    assert fitted_size(2000, 1000, KONTEXT, config) == (512, 256)  # within the side bound
    assert fitted_size(600, 600, KONTEXT, config) == (512, 512)  # and the pixel bound
    assert fitted_size(5, 5, KONTEXT, config) == (16, 16)  # at least one stride
    r = edit(KONTEXT, default_size=(96, 64))
    assert (r.width, r.height) == (96, 64)
    r = edit(KONTEXT, default_size=(96, 64), size="32x48")  # an explicit size wins
    assert (r.width, r.height) == (32, 48)


def test_a_sampler_must_be_one_the_model_offers():
    body = ImageGenerationRequest(prompt="a cat", scheduler="euler")
    spec = generation_spec(body)
    assert to_engine_request(spec, "r", SD, ServerConfig(), GENERATE).scheduler == "euler"
    body = ImageGenerationRequest(prompt="a cat", scheduler="dpm++2m")
    e = error_of(lambda: to_engine_request(generation_spec(body), "r", SD, ServerConfig(),
                                           GENERATE))
    assert (e.status, e.param) == (400, "scheduler") and "ddim, euler" in e.message
