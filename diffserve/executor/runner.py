"""Model runner: loads one diffusers pipeline and runs one batched call per batch.

Works with any diffusers text-to-image pipeline that takes a prompt list and a generator list;
what a pipeline accepts is read off its ``__call__`` signature, not from a list of families.
Torch runs on the thread that built the runner (see DESIGN facts: pool threads are much slower).
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Callable

import numpy as np

from diffserve.models.registry import resolve_model, serving_defaults
from diffserve.protocol import Batch, BatchResult, ImageMeta, ModelInfo, Sample

log = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def pick_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


class ModelRunner:
    def __init__(self, model: str, served_name: str, device: str = "auto", dtype: str = "auto",
                 torch_threads: int = 0) -> None:
        import torch
        from diffusers import DiffusionPipeline

        from diffusers.utils import logging as diffusers_logging
        from transformers.utils import logging as transformers_logging

        # Per-request warnings (e.g. prompt truncation) and progress bars would flood the log.
        diffusers_logging.set_verbosity_error()
        diffusers_logging.disable_progress_bar()
        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()  # "Loading weights" bars at every start
        self._torch = torch
        if torch_threads:  # 0: torch's default (OMP_NUM_THREADS if set, else the cores)
            torch.set_num_threads(torch_threads)
        self.device = pick_device(device)
        if dtype == "auto":
            dtype = "float16" if self.device.startswith("cuda") else "float32"
        self.dtype = dtype
        path = resolve_model(model)
        self.defaults = serving_defaults(path)
        pipe = DiffusionPipeline.from_pretrained(path, dtype=getattr(torch, _DTYPES[dtype]))
        pipe.to(self.device)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe
        self._accepts = set(inspect.signature(pipe.__call__).parameters)
        for required in ("prompt", "generator", "num_inference_steps", "height", "width"):
            if required not in self._accepts:
                raise ValueError(f"{type(pipe).__name__} is not a text-to-image pipeline this server "
                                 f"can drive: its __call__ takes no {required!r}")
        self._extra_kwargs = {k: v for k, v in self.defaults.get("pipeline_kwargs", {}).items()
                              if k in self._accepts}
        # Set by the executor loop to stop a batch early (every caller of it has gone).
        self.should_interrupt: Callable[[], bool] = lambda: False
        self.info = self._model_info(served_name)

    def _model_info(self, served_name: str) -> ModelInfo:
        pipe, d = self.pipe, self.defaults
        call_defaults = {k: p.default for k, p in inspect.signature(pipe.__call__).parameters.items()}
        scale = int(getattr(pipe, "vae_scale_factor", 8) or 8)
        denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
        sample = getattr(pipe, "default_sample_size", None) or getattr(
            getattr(denoiser, "config", None), "sample_size", None) or 64
        native = int(sample) * scale
        # Transformer pipelines patchify latents 2x2, so their pixel sizes step by twice the VAE's.
        stride = d.get("spatial_stride") or scale * (2 if getattr(pipe, "transformer", None) else 1)
        guidance = d.get("guidance_scale", call_defaults.get("guidance_scale"))
        steps = d.get("num_inference_steps", call_defaults.get("num_inference_steps"))
        sched = getattr(getattr(pipe, "scheduler", None), "config", {})
        max_steps = int(sched.get("num_train_timesteps", 1000)) - int(sched.get("steps_offset", 0) or 0)
        return ModelInfo(
            name=served_name, pipeline_class=type(pipe).__name__,
            width=int(d.get("width", native)), height=int(d.get("height", native)),
            spatial_stride=int(stride),
            default_steps=int(steps if isinstance(steps, int) else 30), max_steps=max_steps,
            default_guidance_scale=float(guidance if isinstance(guidance, (int, float)) else 5.0),
            supports_negative_prompt="negative_prompt" in self._accepts,
            device=self.device, dtype=self.dtype)

    def generate(self, params: dict, samples: list[Sample]) -> np.ndarray:
        """One pipeline call for ``samples``; uint8 array (batch, height, width, 3)."""
        torch = self._torch
        kwargs = dict(self._extra_kwargs)
        kwargs.update(
            prompt=[s.prompt for s in samples],
            # One generator per image, so every sample depends on its own seed only.
            generator=[torch.Generator("cpu").manual_seed(s.seed) for s in samples],
            num_inference_steps=params["num_inference_steps"], height=params["height"],
            width=params["width"], output_type="np")
        if "guidance_scale" in self._accepts:
            kwargs["guidance_scale"] = params["guidance_scale"]
        if "negative_prompt" in self._accepts and any(s.negative_prompt for s in samples):
            kwargs["negative_prompt"] = [s.negative_prompt for s in samples]
        if "callback_on_step_end" in self._accepts:
            kwargs["callback_on_step_end"] = self._on_step_end
        with torch.inference_mode():
            images = self.pipe(**kwargs).images
        images = np.asarray(images)
        if images.shape[0] != len(samples):
            raise RuntimeError(f"pipeline returned {images.shape[0]} images for {len(samples)} samples")
        return np.ascontiguousarray((np.clip(images, 0.0, 1.0) * 255.0).round().astype(np.uint8))

    def _on_step_end(self, pipe, step, timestep, callback_kwargs):
        if self.should_interrupt():
            pipe._interrupt = True
        return callback_kwargs

    def execute(self, batch: Batch) -> tuple[BatchResult, list[np.ndarray]]:
        """Run a batch. If the batched call raises, run each request alone so that only the
        request that causes the error fails."""
        start = time.perf_counter()
        try:
            pixels = self.generate(batch.params, batch.samples)
            images = list(pixels)
            metas = [ImageMeta(s.request_id, s.index, s.seed) for s in batch.samples]
            errors: dict[str, str] = {}
        except Exception as batch_error:  # noqa: BLE001 - isolate the culprit below
            log.warning("batch %d failed (%s); retrying its requests one by one",
                        batch.batch_id, batch_error)
            images, metas, errors = [], [], {}
            by_request: dict[str, list[Sample]] = {}
            for s in batch.samples:
                by_request.setdefault(s.request_id, []).append(s)
            for request_id, samples in by_request.items():
                try:
                    pixels = self.generate(batch.params, samples)
                except Exception as error:  # noqa: BLE001 - reported to that request's caller
                    errors[request_id] = f"image generation failed: {type(error).__name__}: {error}"
                    continue
                images.extend(pixels)
                metas.extend(ImageMeta(s.request_id, s.index, s.seed) for s in samples)
        result = BatchResult(batch.batch_id, batch.params["width"], batch.params["height"],
                             time.perf_counter() - start, metas, errors)
        return result, images
