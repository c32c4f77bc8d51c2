"""Each route's body becomes one typed spec, and the images and videos bodies share one set of
field bounds: a videos body is refused where an images body is, with the same OpenAI error."""

from __future__ import annotations

import json

import pytest

from diffserve.config.flags import ServerConfig
from diffserve.errors import APIError, error_response
from diffserve.frontend.bodies import validate
from diffserve.frontend.schemas import ImageEditForm, ImageGenerationRequest, RolloutRequest
from diffserve.frontend.spec import (RequestSpec, edit_spec, generation_spec, rollout_spec,
                                     video_spec)
from diffserve.frontend.validation import to_engine_request
from diffserve.frontend.videos.schemas import VideoCreate
from diffserve.wire.model_info import ModelInfo
from diffserve.wire.tasks import GENERATE
from diffserve.wire.request import DEFAULT_STEPS, SEED_MAX, SEED_MODULUS, ImageRequest

SHARED = ("prompt", "seed", "num_inference_steps", "guidance_scale", "priority", "user",
          "loras")
WAN = ModelInfo(name="tiny-wan", pipeline_class="WanPipeline", width=32, height=32,
                spatial_stride=16, default_steps=4, max_steps=1000, default_guidance_scale=5.0,
                supports_negative_prompt=True, device="cpu", dtype="float32",
                batching_mode="step", tasks=["generate"], partial_images=False, num_frames=9,
                frame_stride=4, fps=16, guidance_scale_2=True)


def error_body(model, fields) -> tuple[int, dict]:
    with pytest.raises(APIError) as caught:
        validate(model, fields)
    response = error_response(caught.value)
    return response.status_code, json.loads(response.body)


@pytest.mark.parametrize("priority", [1_000_001, -1_000_001, 10**12])
def test_a_videos_body_with_a_priority_out_of_range_is_a_400_naming_it(priority):
    status, body = error_body(VideoCreate, {"prompt": "x", "priority": priority})
    assert status == 400 and set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["param"], body["error"]["code"]) == ("priority", "invalid_value")
    assert body["error"]["type"] == "invalid_request_error"
    # The images API refuses it with the same words.
    images = error_body(ImageGenerationRequest, {"prompt": "x", "priority": priority})
    assert images == (status, body)
    assert validate(VideoCreate, {"prompt": "x", "priority": 1_000_000}).priority == 1_000_000


def test_the_shared_fields_have_one_set_of_bounds():
    images = ImageGenerationRequest.model_json_schema()["properties"]
    videos = VideoCreate.model_json_schema()["properties"]

    def bounds(schema: dict) -> dict:
        return {k: v for k, v in schema.items() if k not in ("description", "title", "default")}

    for name in SHARED:
        assert bounds(images[name]) == bounds(videos[name]), name
    for value, accepted in ((SEED_MAX, True), (SEED_MODULUS, False), (-1, False)):
        for model in (ImageGenerationRequest, VideoCreate):
            try:
                validate(model, {"prompt": "x", "seed": value})
                assert accepted, (model, value)
            except APIError as error:
                assert not accepted and error.param == "seed", (model, value)


def test_each_route_makes_its_own_typed_spec():
    generation = generation_spec(ImageGenerationRequest(prompt="x", n=2, seed=3, loras=[
        {"name": "style", "scale": 0.5}]))
    assert isinstance(generation, RequestSpec) and (generation.n, generation.seed) == (2, 3)
    assert generation.loras[0].name == "style" and generation.strength is None
    assert edit_spec(ImageEditForm(prompt="x", strength="0.3")).strength == 0.3
    rollout = rollout_spec(RolloutRequest.model_validate({"prompt": "x", "noise_level": 0.5,
                                                         "return": ["images"]}))
    assert (rollout.noise_level, rollout.returns) == (0.5, ("images",))
    video = video_spec(VideoCreate(prompt="x", guidance_scale_2=2.0, seed=1), 9)
    assert (video.n, video.stream, video.loras, video.scheduler) == (1, False, (), None)
    request = to_engine_request(video, "video_1", WAN, ServerConfig(), GENERATE)
    assert (request.num_frames, request.progress, request.guidance_scale_2) == (9, True, 2.0)
    assert (request.num_inference_steps, request.seed) == (4, 1)


def test_one_default_step_count():
    assert ImageRequest("r", "m", 64, 64).num_inference_steps == DEFAULT_STEPS


def test_a_videos_body_stacks_adapters_as_an_images_body_does():
    """The same field and the same checks: a JSON list (or, in a multipart form, its text),
    each name served, each scale in bounds, ``model=ADAPTER`` first at scale 1."""
    from diffserve.errors import APIError

    text = '[{"name": "style", "scale": 0.5}]'
    video = video_spec(validate(VideoCreate, {"prompt": "x", "model": "ink", "loras": text}), 9)
    request = to_engine_request(video, "video_2", WAN, ServerConfig(), GENERATE,
                                adapters=("ink", "style"))
    assert request.loras == (("ink", 1.0), ("style", 0.5))
    for fields, param in (({"loras": [{"name": "style", "scale": 9}]}, "loras[0].scale"),
                          ({"loras": "not json"}, "loras")):
        try:
            validate(VideoCreate, {"prompt": "x", **fields})
            raise AssertionError(fields)
        except APIError as error:
            assert error.status == 400 and error.param == param, (fields, error.param)
    try:
        to_engine_request(video_spec(VideoCreate(prompt="x", loras=[{"name": "nope"}]), 9),
                          "video_3", WAN, ServerConfig(), GENERATE, adapters=("style",))
        raise AssertionError("an unknown adapter was taken")
    except APIError as error:
        assert error.param == "loras[0].name", error.param
