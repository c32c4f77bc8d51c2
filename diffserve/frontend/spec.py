"""What a route asks of the engine, as one typed value (:class:`RequestSpec`), made from each
route's body by its own conversion: generations, edits, rollouts and videos. The one validation
(:func:`diffserve.frontend.validation.to_engine_request`) reads only this, never a body, so a
field a route lacks has its value here, not a missing attribute."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.frontend.schemas import (ControlRef, ImageEditForm, ImageGenerationRequest,
                                        ImageOptions, LoraRef, RolloutRequest)
from diffserve.frontend.videos.schemas import VideoCreate


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    model: str | None = None
    n: int = 1
    size: str | None = None
    response_format: str = "b64_json"
    stream: bool = False
    partial_images: int = 0
    seed: int | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    priority: int | None = None
    scheduler: str | None = None
    loras: tuple[LoraRef, ...] = ()
    cache_threshold: float | None = None
    controls: tuple[ControlRef, ...] = ()
    strength: float | None = None  # edits that redraw (None: the default strength)
    noise_level: float = 0.0  # rollouts
    returns: tuple[str, ...] = ()  # rollouts: which tensors come back
    num_frames: int = 0  # videos: the frame count (0: an image)
    guidance_scale_2: float | None = None  # videos of two-expert models
    progress: bool = False  # videos: the executor reports its steps


def _image_fields(body: ImageOptions) -> dict:
    return dict(prompt=body.prompt, model=body.model, n=body.n, size=body.size,
                response_format=body.response_format, stream=body.stream,
                partial_images=body.partial_images, seed=body.seed,
                negative_prompt=body.negative_prompt,
                num_inference_steps=body.num_inference_steps,
                guidance_scale=body.guidance_scale, priority=body.priority,
                scheduler=body.scheduler, loras=tuple(body.loras or ()),
                cache_threshold=body.cache_threshold, controls=tuple(body.controls or ()))


def generation_spec(body: ImageGenerationRequest) -> RequestSpec:
    return RequestSpec(**_image_fields(body))


def edit_spec(body: ImageEditForm) -> RequestSpec:
    return RequestSpec(**_image_fields(body), strength=body.strength)


def rollout_spec(body: RolloutRequest) -> RequestSpec:
    return RequestSpec(**_image_fields(body), noise_level=body.noise_level,
                       returns=tuple(body.return_))


def video_spec(body: VideoCreate, num_frames: int) -> RequestSpec:
    """A video is one unstreamed sample with the model's own sampler; its steps are reported as
    it runs."""
    return RequestSpec(prompt=body.prompt, model=body.model, size=body.size, seed=body.seed,
                       negative_prompt=body.negative_prompt,
                       num_inference_steps=body.num_inference_steps,
                       guidance_scale=body.guidance_scale, priority=body.priority,
                       num_frames=num_frames, guidance_scale_2=body.guidance_scale_2,
                       loras=tuple(body.loras or ()), progress=True)
