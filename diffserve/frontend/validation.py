"""Checks that need the server's configuration or the loaded model, and the step from a route's
typed spec (:class:`~diffserve.frontend.spec.RequestSpec`) to the engine's
:class:`~diffserve.wire.request.ImageRequest`. Pure functions."""

from __future__ import annotations

import re
import secrets
from typing import Collection

from diffserve.config.flags import ServerConfig
from diffserve.policies import QUEUE_POLICIES
from diffserve.wire.costs import RowCost, image_cost, uses_cfg, video_cost
from diffserve.errors import invalid_request, model_not_found
from diffserve.frontend.controls import control_cost, control_stack
from diffserve.frontend.spec import RequestSpec
from diffserve.wire.request import SEED_MODULUS, ImageRequest, repeated_adapter
from diffserve.wire.model_info import ModelInfo
from diffserve.wire.tasks import EDIT, GENERATE, Task

DEFAULT_STRENGTH = 0.8  # image-to-image and inpainting, where a request gives none

_SIZE = re.compile(r"^([1-9][0-9]{0,5})x([1-9][0-9]{0,5})$")


def parse_size(size: str | None, info: ModelInfo, config: ServerConfig) -> tuple[int, int]:
    if size is None or size == "auto":
        return info.width, info.height
    match = _SIZE.match(size)
    if not match:
        raise invalid_request(f"size {size!r} is not of the form WIDTHxHEIGHT (e.g. "
                              f"'{info.width}x{info.height}') or 'auto'", "size", "invalid_size")
    width, height = int(match.group(1)), int(match.group(2))
    stride, top = info.spatial_stride, config.max_image_side
    for side in (width, height):
        if side % stride:
            raise invalid_request(f"size {size!r}: width and height must be multiples of {stride} "
                                  f"for this model", "size", "invalid_size")
        if side > top:
            raise invalid_request(f"size {size!r}: width and height must be at most {top}",
                                  "size", "invalid_size")
    if width * height > config.max_image_pixels:
        raise invalid_request(f"size {size!r} is {width * height} pixels; this server allows at "
                              f"most {config.max_image_pixels} pixels", "size", "invalid_size")
    return width, height


def fitted_size(width: int, height: int, info: ModelInfo, config: ServerConfig) -> tuple[int, int]:
    """An input image's size made a valid output size: scaled down (aspect kept) to the side and
    pixel bounds, then each side rounded down to the model's stride (at least one stride)."""
    scale = min(1.0, config.max_image_side / max(width, height),
                (config.max_image_pixels / (width * height)) ** 0.5)
    stride = info.spatial_stride
    return tuple(max(stride, int(side * scale) // stride * stride) for side in (width, height))


def lora_stack(body: RequestSpec, info: ModelInfo, adapters: Collection[str],
               config: ServerConfig) -> tuple[tuple[str, float], ...]:
    """The request's adapters and scales: ``model`` naming an adapter is that adapter at scale
    1, ahead of the ``loras`` field's."""
    stack: list[tuple[str, float]] = []
    if body.model is not None and body.model != info.name:
        if body.model not in adapters:
            raise model_not_found(body.model, info.name, adapters)
        stack.append((body.model, 1.0))
    for i, ref in enumerate(body.loras):
        if ref.name not in adapters:
            raise model_not_found(ref.name, info.name, adapters, f"loras[{i}].name")
        stack.append((ref.name, float(ref.scale)))
    repeated = repeated_adapter(stack)
    if repeated is not None:
        raise invalid_request(f"adapter {repeated!r} is named twice (in model and loras, or "
                              "twice in loras)", "loras", "duplicate_adapter")
    if len(stack) > config.max_loras_per_request:
        raise invalid_request(f"{len(stack)} adapters; this server stacks at most "
                              f"{config.max_loras_per_request} per request "
                              "(--max-loras-per-request)", "loras", "too_many_adapters")
    return tuple(stack)


def priority_of(body: RequestSpec, config: ServerConfig, key_priority: int | None) -> int:
    """The request's priority class: its own, or its API key's, never better than the key's
    (a better one is lowered to it)."""
    asked = body.priority
    if asked not in (None, 0) and not QUEUE_POLICIES[config.scheduling_policy].uses_priority:
        raise invalid_request(f"priority={asked} needs --scheduling-policy priority (this server "
                              f"runs {config.scheduling_policy})", "priority", "unsupported_parameter")
    if key_priority is None:
        return asked or 0
    return key_priority if asked is None else max(asked, key_priority)


def to_engine_request(body: RequestSpec, request_id: str, info: ModelInfo,
                      config: ServerConfig, task: Task, adapters: Collection[str] = (),
                      references: int = 0, size: tuple[int, int] | None = None,
                      key_priority: int | None = None) -> ImageRequest:
    """``body``: the route's spec; ``adapters``: the names of the LoRA adapters served now;
    ``references``: an instruction edit's image count; ``size``: the size when the body has
    none (default: the native one); ``key_priority``: the priority class of the API key it
    came with."""
    loras = lora_stack(body, info, adapters, config)
    frames = body.num_frames  # a video's, checked by its route
    if bool(frames) != bool(info.num_frames):
        made, route = (("videos", "POST /v1/videos") if info.num_frames else
                       ("images", "/v1/images/generations or /v1/images/edits"))
        raise invalid_request(f"model {info.name!r} ({info.pipeline_class}) makes {made}: use "
                              f"{route}", None, "unsupported_task")
    if task.name in info.unavailable_tasks:
        raise invalid_request(f"model {info.name!r} ({info.pipeline_class}) does not serve "
                              f"{task.name}: at start-up {info.unavailable_tasks[task.name]}",
                              task.inputs[-1].param if task.inputs else None, "unsupported_task")
    if task.name not in info.tasks:
        if task is GENERATE and EDIT.name in info.tasks:
            raise invalid_request(f"model {info.name!r} ({info.pipeline_class}) only edits images: "
                                  "send the image(s) and the instruction to /v1/images/edits",
                                  None, "unsupported_task")
        raise invalid_request(f"model {info.name!r} ({info.pipeline_class}) cannot do "
                              f"{task.name} ({task.description}): that needs {task.needs} (it "
                              f"supports: {', '.join(info.tasks)})",
                              task.inputs[-1].param if task.inputs else None,
                              "unsupported_task")
    given_strength = body.strength
    if task.references and given_strength is not None:
        raise invalid_request(f"model {info.name!r} ({info.pipeline_class}) edits by instruction "
                              "and takes no strength; leave it out", "strength",
                              "unsupported_parameter")
    if task.references and not 1 <= references <= info.max_edit_images:
        raise invalid_request(f"{references} input images; model {info.name!r} takes at most "
                              f"{info.max_edit_images} per edit", "image", "invalid_value")
    if body.response_format == "url" and body.stream:
        raise invalid_request("response_format='url' is not streamed: a stream's events carry "
                              "base64 images", "response_format", "unsupported_value")
    if body.n > config.max_n:
        raise invalid_request(f"n={body.n} is above this server's limit of {config.max_n}", "n",
                              "invalid_value")
    for param, text in (("prompt", body.prompt), ("negative_prompt", body.negative_prompt or "")):
        if len(text) > config.max_prompt_chars:
            raise invalid_request(f"{param} is {len(text)} characters long; the limit is "
                                  f"{config.max_prompt_chars}", param, "string_above_max_length")
        if "\x00" in text:
            raise invalid_request(f"{param} contains a NUL character", param, "invalid_value")
    if not body.prompt.strip():
        raise invalid_request("prompt is empty", "prompt", "invalid_value")
    if body.negative_prompt and not info.supports_negative_prompt:
        raise invalid_request(f"model {info.name!r} ({info.pipeline_class}) does not take a "
                              "negative_prompt", "negative_prompt", "unsupported_parameter")
    steps = body.num_inference_steps or info.default_steps
    limit = min(config.max_inference_steps, info.max_steps)
    if steps > limit:
        raise invalid_request(f"num_inference_steps={steps} is above the limit of {limit} "
                              f"(--max-inference-steps, and the model's noise schedule)",
                              "num_inference_steps", "invalid_value")
    strength = 1.0
    if task.from_image:
        strength = DEFAULT_STRENGTH if given_strength is None else given_strength
    if task.from_image and int(steps * strength) < 1:
        raise invalid_request(f"strength={strength:g} with num_inference_steps={steps} leaves no "
                              "denoising step; raise either", "strength", "invalid_value")
    if body.scheduler is not None and body.scheduler not in info.schedulers:
        raise invalid_request(f"scheduler {body.scheduler!r} is not one this model offers: "
                              f"{', '.join(info.schedulers) or 'none'}", "scheduler",
                              "invalid_value")
    width, height = (size if size and body.size in (None, "auto") else
                     parse_size(body.size, info, config))
    guidance = info.default_guidance_scale if body.guidance_scale is None else body.guidance_scale
    negative = body.negative_prompt or ""
    cfg = uses_cfg(info.guidance_rule, guidance, negative)
    controls = control_stack(body.controls, info, config, task)
    row = RowCost.of(info.row_cost)  # the model's fitted FLOPs a row, or its tokens
    cost = (video_cost(width, height, frames, info.width, info.height, info.num_frames,
                       info.frame_stride, cfg, row) if frames
            else image_cost(width, height, info.width, info.height, cfg, row)
            * (1 + control_cost(controls, info)))
    if info.memory_cost_bound and cost > info.memory_cost_bound:
        raise invalid_request(
            f"size {width}x{height} costs {cost:g} per image, more than the {info.memory_cost_bound:.3g} "
            f"the server's memory budget of {info.memory_budget_bytes / 1e6:.0f} MB holds beside "
            "its weights (--device-memory-bytes, --gpu-memory-utilization)", "size",
            "exceeds_memory_budget")
    if info.max_batch_cost and cost > info.max_batch_cost:
        raise invalid_request(
            f"size {width}x{height} costs {cost:g} per image ({'with' if cfg else 'without'} "
            f"classifier-free guidance, in rows of the native {info.width}x{info.height}), above "
            f"the {info.max_batch_cost:g} one denoiser forward may carry (--max-batch-cost)",
            "size", "invalid_size")
    threshold = body.cache_threshold
    if threshold:
        if not info.step_cache:
            raise invalid_request("cache_threshold needs a server that runs a step cache "
                                  "(--step-cache, in step mode)", "cache_threshold",
                                  "unsupported_parameter")
        if task.trajectory:
            raise invalid_request("rollouts are never cached: their log-probabilities are of the "
                                  "model's own predictions", "cache_threshold",
                                  "unsupported_parameter")
    seed = body.seed if body.seed is not None else secrets.randbelow(SEED_MODULUS)
    return ImageRequest(
        request_id=request_id, model=info.name, width=width, height=height, task=task.name,
        num_inference_steps=steps, guidance_scale=float(guidance), strength=float(strength),
        scheduler=body.scheduler or "", priority=priority_of(body, config, key_priority),
        prompt=body.prompt, negative_prompt=negative, seed=seed, n=body.n,
        # Previews exist only in a stream; without one they would be decoded for nothing.
        partial_images=body.partial_images if body.stream else 0, loras=loras, cost=cost,
        references=references if task.references else 0, num_frames=frames,
        noise_level=float(body.noise_level), cache_threshold=threshold, returns=body.returns,
        controls=controls, guidance_scale_2=body.guidance_scale_2, progress=body.progress)
