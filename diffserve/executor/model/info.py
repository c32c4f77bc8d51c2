"""What the frontend validates against and the scheduler admits by (:class:`ModelInfo`), read off
the loaded pipeline and its serving defaults; and how a prompt's tokens are counted for usage."""

from __future__ import annotations

import inspect
from typing import Any

from diffserve.config.flags import ServerConfig
from diffserve.wire.costs import ABOVE_ONE, default_bounds, image_cost, uses_cfg
from diffserve.executor.model.loading import LoadedModel
from diffserve.executor.model.placements import placements
from diffserve.executor.model.samplers import offered
from diffserve.wire.protocol import STEP_MODE
from diffserve.wire.model_info import ModelInfo
from diffserve.wire.tasks import EDIT, IMAGE_TO_IMAGE
from diffserve.wire.request import DEFAULT_STEPS

DEFAULT_FPS = 16  # Wan's; a video model's diffserve.json may say otherwise


def model_info(loaded: LoadedModel, config: ServerConfig, mode: str, family: type | None,
               tasks: list[str], adapters: list[str] | None = None,
               task_modes: dict[str, str] | None = None,
               unavailable: dict[str, str] | None = None, group=None,
               controls: list | None = None) -> ModelInfo:
    """What the frontend validates against and the scheduler admits by; ``family``: the step
    engine's family class, if any; ``task_modes``: each task's batching mode (default: ``mode``
    for all); ``unavailable``: tasks the model has but cannot serve, with why; ``controls``:
    the served control models' descriptions."""
    pipe, d = loaded.pipe, loaded.defaults
    call_defaults = {k: p.default for k, p in inspect.signature(pipe.__call__).parameters.items()}
    scale = int(getattr(pipe, "vae_scale_factor", None)
                or getattr(pipe, "vae_scale_factor_spatial", 8) or 8)
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    sample = getattr(pipe, "default_sample_size", None) or getattr(
        getattr(denoiser, "config", None), "sample_size", None) or 64
    native = int(sample) * scale
    video = video_defaults(pipe, d, call_defaults)
    if video["num_frames"]:  # video pipelines name their native size in their call's defaults
        native_w, native_h = (call_defaults.get(side) for side in ("width", "height"))
        if isinstance(native_w, int) and isinstance(native_h, int):
            d = {"width": native_w, "height": native_h, **d}
    # Transformer pipelines patchify latents 2x2, so their pixel sizes step by twice the VAE's.
    stride = d.get("spatial_stride") or scale * (2 if getattr(pipe, "transformer", None) else 1)
    guidance = d.get("guidance_scale", call_defaults.get(
        family.guidance_kwarg if family else "guidance_scale"))
    # The step count: the serving defaults', else the pipeline's own, else DEFAULT_STEPS.
    steps = d.get("num_inference_steps", call_defaults.get("num_inference_steps"))
    sched = getattr(getattr(pipe, "scheduler", None), "config", {})
    max_steps = int(sched.get("num_train_timesteps", 1000)) - int(sched.get("steps_offset", 0) or 0)
    guidance = float(guidance if isinstance(guidance, (int, float)) else 5.0)
    rule = family.guidance_rule if family else ABOVE_ONE
    batch_cost, running_cost = default_bounds(
        config.dynamic_batch_max_size, config.max_batch_cost, config.max_running_cost,
        image_cost(1, 1, 1, 1, uses_cfg(rule, guidance, "")))
    return ModelInfo(
        name=config.model_name, pipeline_class=type(pipe).__name__,
        width=int(d.get("width", native)), height=int(d.get("height", native)),
        spatial_stride=int(stride),
        default_steps=int(steps if isinstance(steps, int) else DEFAULT_STEPS),
        max_steps=max_steps,
        default_guidance_scale=guidance,
        supports_negative_prompt="negative_prompt" in loaded.accepts,
        device=loaded.device, dtype=loaded.dtype, batching_mode=mode, tasks=tasks,
        task_modes=task_modes or {task: mode for task in tasks},
        unavailable_tasks=unavailable or {},
        partial_images=family is not None and not video["num_frames"],
        family=family.name if family else None, **video,
        max_edit_images=(family.max_references if family and EDIT.name in tasks else
                         1 if IMAGE_TO_IMAGE.name in tasks else 0),
        guidance_rule=rule, schedulers=offered(pipe.scheduler) if getattr(pipe, "scheduler", None)
        else [], adapters=adapters or [], max_batch_cost=batch_cost,
        max_running_cost=running_cost,
        step_cache=mode == STEP_MODE and config.step_cache != "off",
        parallel=config.degrees.describe(config.num_executors),
        components=placements(pipe, group), random_weights=loaded.random_weights,
        controls_supported=bool(family and family.control_classes),
        control_models=controls or [], max_controls=config.max_controls_per_request)


def video_defaults(pipe, defaults: dict[str, Any], call_defaults: dict[str, Any]) -> dict[str, Any]:
    """A video pipeline's (one whose call takes ``num_frames``) native frame count, temporal
    stride and frame rate, and whether it takes a second guidance scale; zeros for images."""
    if "num_frames" not in call_defaults:
        return {"num_frames": 0}
    frames = defaults.get("num_frames", call_defaults["num_frames"])
    vocoder = getattr(pipe, "vocoder", None)  # a model that makes the video's sound too
    return {"num_frames": int(frames if isinstance(frames, int) else 49),
            "frame_stride": int(getattr(pipe, "vae_scale_factor_temporal", None)
                                or getattr(pipe, "vae_temporal_compression_ratio", 1) or 1),
            "fps": int(defaults.get("fps", DEFAULT_FPS)),
            "guidance_scale_2": getattr(pipe, "transformer_2", None) is not None,
            "audio_sample_rate": int(vocoder.config.output_sampling_rate) if vocoder else 0}


def token_counter(pipe):
    """Counts a prompt's tokens with the pipeline's (first) tokenizer, as it will encode it:
    the figure reported as usage. 0 where the pipeline has no tokenizer."""
    tokenizer = getattr(pipe, "tokenizer", None)
    if tokenizer is None:
        return lambda prompt: 0
    limit = getattr(tokenizer, "model_max_length", None)
    limit = limit if isinstance(limit, int) and limit < 100_000 else None

    def count(prompt: str) -> int:
        return len(tokenizer(prompt, truncation=limit is not None, max_length=limit).input_ids)

    return count
