"""Loading a pipeline once, and what both engines share about it: the device and dtype, the
serving defaults, what the pipeline's ``__call__`` takes, the model info for the frontend, and
the batching mode it will run in."""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Any

from diffserve.config import ConfigError, ServerConfig
from diffserve.executor.parallel import Degrees
from diffserve.costs import ABOVE_ONE, default_bounds, image_cost, uses_cfg
from diffserve.executor.components import placements
from diffserve.executor.devices import pick_device, pipeline_class_of, resolve_dtype, use_device
from diffserve.executor.samplers import offered
from diffserve.models.registry import resolve_model, serving_defaults
from diffserve.protocol import REQUEST_MODE, STEP_MODE, ModelInfo
from diffserve.tasks import EDIT, GENERATE, IMAGE_TO_IMAGE, TASKS

log = logging.getLogger(__name__)

# Keyword arguments the server always sets, whatever the model directory's defaults say:
# the server has validated the size, so a pipeline must not silently change it.
FORCED_KWARGS = {"use_resolution_binning": False}
DEFAULT_FPS = 16  # Wan's; a video model's diffserve.json may say otherwise


class UnsupportedMode(ConfigError):
    """--batching-mode step on a pipeline whose family the step engine does not know."""


def leave_out_unused_libraries(serves_adapters: bool, quantization: str,
                               text_encoder_quantization: str = "none") -> None:
    """Keep PEFT and torchao unimported in an executor that will not use them. diffusers (and
    transformers) import both at start wherever they are installed: about 1 CPU-s of the 6
    an executor takes to become ready, and torchao's warnings about kernels this machine lacks
    in every server log. A ``None`` entry in ``sys.modules`` is Python's own way to say a
    module is absent: the libraries then see the package as not installed. Call it only in a
    process of its own, before diffusers is imported (later it would change nothing, and it
    would hide the package from code in the same process that needs it)."""
    if "diffusers" in sys.modules:
        return
    if not serves_adapters:
        sys.modules.setdefault("peft", None)
    if quantization == "none" and text_encoder_quantization == "none":
        sys.modules.setdefault("torchao", None)


# What the libraries log while they import, at every start, that tells an operator nothing:
# torchao's kernels this machine lacks ("Failed to load ..._C_mxfp8"), torch's deprecation of how
# torchao registers its enums, and diffusers' "Unable to import `torchao` Tensor objects" where its
# list of torchao classes is older than the installed torchao. Where quantization cannot run,
# diffserve says so itself, once (diffserve.executor.quantization).
NOISY_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_imports() -> None:
    """Before torch and diffusers are imported: only errors from what they log as they import.
    diffusers and transformers take their level from the environment when they first log
    (an operator's own DIFFUSERS_VERBOSITY or TRANSFORMERS_VERBOSITY is kept)."""
    for name in NOISY_IMPORT_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    import os

    for variable in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY"):
        os.environ.setdefault(variable, "error")


def quiet_libraries() -> None:
    """Per-request warnings (prompt truncation) and progress bars would flood the server log."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()  # "Loading weights" bars at every start


@dataclass
class LoadedModel:
    """A pipeline on its device, with what the engines need to know about it."""

    pipe: Any
    device: str
    dtype: str
    defaults: dict[str, Any]
    accepts: frozenset[str]  # the parameters of the pipeline's __call__
    call_kwargs: dict[str, Any]  # passed to every call: the model dir's, then the forced ones

    @property
    def pipeline_class(self) -> str:
        return type(self.pipe).__name__


def auto_dtype(requested: str, device: str, path: str) -> str:
    """The weights' dtype (:func:`~diffserve.executor.devices.resolve_dtype`, with the family the
    model directory declares); ``auto``'s choice is logged."""
    from diffserve.executor.families import family_for

    pipeline = pipeline_class_of(path)
    family = family_for(pipeline) if pipeline else None
    dtype = resolve_dtype(requested, device, family.published_dtype if family else None)
    if requested == "auto" and device.startswith("cuda"):
        log.info("--dtype auto: %s on %s (%s)", dtype, device,
                 f"the {family.name} family's published dtype" if family else
                 "the default for a pipeline the step engine does not know")
    return dtype


def load_model(model: str, device: str = "auto", dtype: str = "auto", torch_threads: int = 0,
               index: int = 0, quantization: str = "none", components=None, layout=None,
               text_encoder_quantization: str = "none") -> LoadedModel:
    """``quantization``: a scheme of :mod:`diffserve.executor.quantization` for the denoiser
    (``text_encoder_quantization`` for the text encoders); ``components(path, dtype)``: pipeline
    components loaded beforehand (a tensor-parallel denoiser, sharded as it loads), by name;
    ``layout``: a :class:`~diffserve.executor.memory_layout.MemoryLayout` (offloading,
    placement, tiling), applied instead of moving everything to ``device``."""
    quiet_imports()
    import torch
    from diffusers import DiffusionPipeline

    from diffserve.executor import quantization as quant
    from diffserve.executor.compat import allow_processors_without_torchvision

    quiet_libraries()
    if torch_threads:  # 0: torch's default (OMP_NUM_THREADS if set, else the cores)
        torch.set_num_threads(torch_threads)
    device = pick_device(device, index)
    use_device(device)
    path = resolve_model(model)
    dtype = auto_dtype(dtype, device, path)
    defaults = serving_defaults(path)
    allow_processors_without_torchvision()
    quantized = quant.pipeline_config(quantization, path, device, text_encoder_quantization)
    prebuilt = components(path, getattr(torch, dtype)) if components else {}
    pipe = DiffusionPipeline.from_pretrained(path, dtype=getattr(torch, dtype), **prebuilt,
                                             **({"quantization_config": quantized} if quantized
                                                else {}))
    if layout is None or layout.plain:
        pipe.to(device)
    else:
        layout.apply(pipe, device)
        log.info("memory layout: %s", layout.describe())
    if quantized:
        quant.log_weights(quantization, [getattr(pipe, name) for name in quant.DENOISERS
                                         if getattr(pipe, name, None) is not None])
    pipe.set_progress_bar_config(disable=True)
    accepts = frozenset(inspect.signature(pipe.__call__).parameters)
    for required in ("prompt", "generator", "num_inference_steps", "height", "width"):
        if required not in accepts:
            raise ValueError(f"{type(pipe).__name__} is not a text-to-image pipeline this server "
                             f"can drive: its __call__ takes no {required!r}")
    kwargs = {k: v for k, v in defaults.get("pipeline_kwargs", {}).items() if k in accepts}
    kwargs.update({k: v for k, v in FORCED_KWARGS.items() if k in accepts})
    return LoadedModel(pipe, device, dtype, defaults, accepts, kwargs)


def resolve_mode(requested: str, family: type | None, pipeline_class: str) -> str:
    """The batching mode to run: ``auto`` takes the step engine where it knows the family."""
    if requested == STEP_MODE and family is None:
        from diffserve.executor.families import supported_pipelines

        raise UnsupportedMode(
            f"--batching-mode step does not support {pipeline_class}; it runs "
            f"{', '.join(supported_pipelines())}. Use --batching-mode request (or auto) for this "
            "model.")
    if requested == REQUEST_MODE or family is None:
        return REQUEST_MODE
    return STEP_MODE


def model_info(loaded: LoadedModel, config: ServerConfig, mode: str, family: type | None,
               tasks: list[str], adapters: list[str] | None = None,
               task_modes: dict[str, str] | None = None,
               unavailable: dict[str, str] | None = None, group=None) -> ModelInfo:
    """What the frontend validates against and the scheduler admits by; ``family``: the step
    engine's family class, if any; ``task_modes``: each task's batching mode (default: ``mode``
    for all); ``unavailable``: tasks the model has but cannot serve, with why."""
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
        default_steps=int(steps if isinstance(steps, int) else 30), max_steps=max_steps,
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
        parallel=Degrees.of(config).describe(config.num_executors),
        components=placements(pipe, group))


def video_defaults(pipe, defaults: dict[str, Any], call_defaults: dict[str, Any]) -> dict[str, Any]:
    """A video pipeline's (one whose call takes ``num_frames``) native frame count, temporal
    stride and frame rate, and whether it takes a second guidance scale; zeros for images."""
    if "num_frames" not in call_defaults:
        return {"num_frames": 0}
    frames = defaults.get("num_frames", call_defaults["num_frames"])
    return {"num_frames": int(frames if isinstance(frames, int) else 49),
            "frame_stride": int(getattr(pipe, "vae_scale_factor_temporal", 1) or 1),
            "fps": int(defaults.get("fps", DEFAULT_FPS)),
            "guidance_scale_2": getattr(pipe, "transformer_2", None) is not None}


def takes_first_frame(pipe) -> bool:
    """A video pipeline conditioned on an input image (its first frame), not redrawing it."""
    params = inspect.signature(pipe.__call__).parameters
    return "num_frames" in params and "image" in params and "strength" not in params


def task_pipelines(pipe, family: type | None = None) -> dict[str, Any]:
    """Task name -> the pipeline that runs it: the loaded one for generation (unless its family
    only edits), for instruction edits (where the ``family`` conditions on reference images)
    and for rollouts (where the step engine knows the ``family`` and the rollout sampler the
    scheduler); and for image-to-image and inpainting, the auto-pipeline of the loaded one's
    family, built from its own components (no second copy of the weights), where it has one
    that redraws an input image by ``strength``. A model without a pipeline lacks the task."""
    import diffusers

    from diffserve.executor.rollout import samples_with

    found: dict[str, Any] = {}
    if family.generates if family is not None else not takes_first_frame(pipe):
        found[GENERATE.name] = pipe
    for task in TASKS.values():
        if task.first_frame:
            if takes_first_frame(pipe):
                found[task.name] = pipe
            continue
        if task.trajectory:
            if family is not None and family.generates and samples_with(pipe.scheduler):
                found[task.name] = pipe
            continue
        if task.references:
            if family is not None and family.max_references:
                found[task.name] = pipe
            continue
        if task.auto_pipeline is None or (family is not None
                                          and task.name not in family.strength_tasks):
            continue
        try:
            built = getattr(diffusers, task.auto_pipeline).from_pipe(pipe)
        except (ValueError, KeyError, TypeError) as error:
            log.info("no %s pipeline for %s: %s", task.name, type(pipe).__name__, error)
            continue
        if "strength" not in inspect.signature(built.__call__).parameters:
            # e.g. FLUX.1 Kontext's and Qwen-Image-Edit's own pipelines stand in for their
            # image-to-image: they edit by instruction (the edit task), not by strength.
            log.info("no %s pipeline for %s: %s takes no strength", task.name,
                     type(pipe).__name__, type(built).__name__)
            continue
        built.set_progress_bar_config(disable=True)
        found[task.name] = built
    return found


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
