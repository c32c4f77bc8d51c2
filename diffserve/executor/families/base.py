"""What a pipeline family gives the step engine, built from the pipeline's own components.

The step engine (:mod:`diffserve.executor.step_engine`) runs one loop for every family: admit,
one batched denoiser forward, each request's own scheduler step, retire. A family supplies only
what differs: how prompts are encoded, how a request's noise schedule and first latents are
prepared (by the family's own text-to-image, image-to-image and inpainting pipelines), what the
denoiser takes, and how latents become pixels.

Preparation calls the pipelines' own helpers (``prepare_latents``, ``get_timesteps``,
``prepare_mask_latents``...) with the request's own scheduler swapped in for the duration of the
call, because those helpers read ``self.scheduler`` (``init_noise_sigma``, ``add_noise``, the begin
index): with the shared scheduler they would see another request's timesteps.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from diffserve.protocol import GENERATE


@contextmanager
def scheduler_swapped(pipe, scheduler):
    """``pipe`` with ``scheduler`` in place of its own, for one helper call. Bypasses the
    pipeline's ``__setattr__``, which would rewrite its config on every swap."""
    saved = pipe.__dict__["scheduler"]
    object.__setattr__(pipe, "scheduler", scheduler)
    try:
        yield pipe
    finally:
        object.__setattr__(pipe, "scheduler", saved)


@dataclass
class Conditioning:
    """Text conditioning of one request: tensors with one row per prompt (the request's prompt
    and, with classifier-free guidance, its negative prompt)."""

    positive: dict[str, Any]
    negative: dict[str, Any] | None = None


@dataclass
class Prepared:
    """A request's starting point: its schedule, its first latents, and for inpainting what
    each step blends back in outside the mask."""

    timesteps: Any
    latents: Any
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    blend: dict[str, Any] | None = None  # inpainting: mask, image_latents, noise
    cond: Conditioning | None = None  # per-request conditioning beyond the prompt (SDXL sizes)


class Family:
    name: ClassVar[str]
    pipelines: ClassVar[tuple[str, ...]]  # text-to-image pipeline classes this family drives
    # Flow-matching families (SD3, Flux) neither scale the denoiser's input nor add noise the
    # DDPM way; the others' schedulers do both.
    flow_matching: ClassVar[bool] = False

    def __init__(self, pipe, edits: dict[str, Any], call_kwargs: dict[str, Any]) -> None:
        import torch

        self.torch = torch
        self.pipe = pipe
        self.edits = edits  # task -> pipeline built with from_pipe (shares every component)
        self.call_kwargs = call_kwargs
        self.device = pipe._execution_device
        self.dtype = self.denoiser.dtype

    @property
    def denoiser(self):
        return getattr(self.pipe, "unet", None) or self.pipe.transformer

    # -- per admission ---------------------------------------------------------------------

    def new_scheduler(self):
        return copy.deepcopy(self.pipe.scheduler)

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether the family's own pipeline runs classifier-free guidance at this scale."""
        return guidance_scale > 1

    def encode(self, prompts: list[str], negatives: list[str] | None, cfg: bool) -> Conditioning:
        """One call of the pipeline's ``encode_prompt`` for several prompts. ``negatives`` is None
        where the pipeline would get no negative prompt (which some families treat differently
        from an empty one)."""
        raise NotImplementedError

    def prepare(self, task: str, scheduler, steps: int, strength: float, width: int, height: int,
                generators: list, cond_dtype, image=None, mask=None) -> Prepared:
        raise NotImplementedError

    # -- per step --------------------------------------------------------------------------

    def forward(self, latents, timesteps, cond: dict[str, Any], guidance, width: int,
                height: int) -> Any:
        """One denoiser forward over stacked rows: ``timesteps`` and ``guidance`` have one
        value per row, ``cond`` one row per row of ``latents``; every row has this size."""
        raise NotImplementedError

    def renoise(self, scheduler, image_latents, noise, timestep) -> Any:
        """Inpainting: the input's latents at the noise level of ``timestep``, which each step
        blends back in outside the mask."""
        t = self.torch.tensor([timestep])
        if self.flow_matching:
            return scheduler.scale_noise(image_latents, t, noise)
        return scheduler.add_noise(image_latents, noise, t)

    # -- at the end ------------------------------------------------------------------------

    def decode(self, latents, width: int, height: int, task: str = GENERATE) -> np.ndarray:
        """Latents of finished samples to uint8 pixels (k, height, width, 3), as the pipeline of
        ``task`` decodes them."""
        raise NotImplementedError

    # -- shared helpers --------------------------------------------------------------------

    def _postprocess(self, image) -> np.ndarray:
        pixels = self.pipe.image_processor.postprocess(
            image, output_type="np", do_denormalize=[True] * image.shape[0])
        return to_uint8(pixels)

    def _image_tensor(self, pipe, image, width: int, height: int):
        """An input frame (uint8, height x width x 3) as the pipeline would preprocess it."""
        from PIL import Image

        return pipe.image_processor.preprocess(Image.fromarray(image), height=height, width=width)

    def _mask_tensor(self, pipe, mask, width: int, height: int):
        from PIL import Image

        return pipe.mask_processor.preprocess(Image.fromarray(mask), height=height, width=width)

    def _schedule(self, scheduler, steps: int, width: int, height: int):
        """A request's whole noise schedule, set on its own scheduler as the family's
        text-to-image pipeline sets it (families with shifted schedules override this)."""
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

        return retrieve_timesteps(scheduler, steps, self.device)[0]

    def _edit_schedule(self, pipe, scheduler, steps: int, strength: float, width: int,
                       height: int):
        """An edit's schedule: the whole one, cut by ``strength`` by the edit pipeline's own
        ``get_timesteps`` (which also sets the scheduler's begin index). Call it with the
        request's scheduler swapped into ``pipe``."""
        self._schedule(scheduler, steps, width, height)
        timesteps, remaining = pipe.get_timesteps(steps, strength, self.device)
        if remaining < 1:
            raise ValueError(f"strength {strength} leaves no denoising step of {steps}")
        return timesteps


def to_uint8(pixels) -> np.ndarray:
    """Float pixels in [0, 1] (k, H, W, 3) to contiguous uint8, the one rounding rule everywhere."""
    return np.ascontiguousarray((np.clip(np.asarray(pixels), 0.0, 1.0) * 255.0).round().astype(np.uint8))


def rows(tensor, count: int):
    """``tensor``'s single row repeated ``count`` times (a request's prompt for each of its images)."""
    return tensor.repeat(count, *([1] * (tensor.dim() - 1)))
