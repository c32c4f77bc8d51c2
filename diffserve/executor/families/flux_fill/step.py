"""FLUX.1 Fill: Flux that inpaints by conditioning, not by blending. Each step its transformer
takes, beside the latents' tokens, the masked input image's latents and the mask packed into
tokens (concatenated on the channel axis); nothing is put back outside the mask. It has no
text-to-image call (the pipeline needs an image and a mask), so inpainting is its one task, run
by diffusers' ``FluxFillPipeline`` over the loaded components. Guidance is Flux's embedding (no
CFG pass); ``strength`` cuts the schedule as for Flux's other edits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from diffserve.executor.families.conditioning import Prepared
from diffserve.executor.families.flux.step import Flux, FluxConditioning
from diffserve.executor.families.schedulers import scheduler_swapped
from diffserve.wire.tasks import INPAINT


@dataclass
class FillConditioning(FluxConditioning):
    # The masked image's packed latents and the packed mask, side by side: one row per image.
    fill: Any = None


class FluxFill(Flux):
    name = "flux-fill"
    mixes_sizes = False  # its own forward takes one size (docs/batching.md)
    pipelines = ("FluxFillPipeline",)
    generates = False  # the pipeline needs an image and a mask
    strength_pipelines = {INPAINT.name: "FluxFillPipeline"}
    # No ControlNet pipeline in diffusers takes the Fill model.
    control_classes = ()
    control_pipelines = {}
    control_image_kwarg = {}

    @property
    def _channels(self) -> int:
        # The transformer's input is wider than the latents (latents, masked image, mask).
        return self.pipe.vae.config.latent_channels

    def encode(self, prompts, negatives, cfg):
        encoded = super().encode(prompts, negatives, cfg)
        return type(encoded)(FillConditioning(**vars(encoded.positive)))

    def prepare(self, task, scheduler, steps, strength, width, height, generators, encoded,
                inputs, frames=0, controls=()):
        if not task.masked:
            return super().prepare(task, scheduler, steps, strength, width, height, generators,
                                   encoded, inputs, frames, controls)
        # FluxFillPipeline's order: the schedule cut by strength, the noised image's latents
        # (a VAE sample, then the noise), then the masked image's latents (another sample).
        k, dtype = len(generators), encoded.positive.dtype
        pipe = self.pipelines[task.name]
        init = self.image_tensor(pipe, inputs["image"], width, height).repeat(k, 1, 1, 1)
        mask = self.mask_tensor(pipe, inputs["mask_image"], width, height).repeat(k, 1, 1, 1)
        with scheduler_swapped(pipe, scheduler):
            timesteps = self.edit_schedule(pipe, scheduler, steps, strength, width, height)
            latents = self.image_latents(pipe, init, timesteps[:1].repeat(k), k, width, height,
                                         dtype, generators)
            masked = (init * (1 - mask)).to(self.device, dtype)
            mask, masked_latents = pipe.prepare_mask_latents(
                mask, masked, k, self._channels, 1, height, width, dtype, self.device, generators)
            step_kwargs = self.step_kwargs(pipe, generators)
        positive, _ = self.request_conditioning(task, width, height, encoded)
        positive = dataclasses.replace(
            positive, fill=self.torch.cat((masked_latents, mask), dim=-1))
        return Prepared(timesteps, latents, positive, None, step_kwargs)

    def forward(self, latents, timesteps, cond, guidance, width, height, control=None):
        # The prediction is of the latents' channels alone (the transformer's out_channels).
        return super().forward(self.torch.cat((latents, cond.fill), dim=2), timesteps, cond,
                               guidance, width, height)


FAMILIES = (FluxFill,)
