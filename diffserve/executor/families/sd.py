"""Stable Diffusion 1.x/2.x: a UNet over 4-channel latents, one CLIP text encoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffserve.executor.families.base import Family
from diffserve.executor.families.conditioning import Conditioning, Encoded


@dataclass
class SDConditioning(Conditioning):
    prompt_embeds: Any


class StableDiffusion(Family):
    name = "stable-diffusion"
    published_dtype = "float16"  # SD 1.x/2.x and SDXL (a subclass) are published in float16
    pipelines = ("StableDiffusionPipeline",)

    def encode(self, prompts, negatives, cfg):
        positive, negative = self.pipe.encode_prompt(prompts, self.device, 1, cfg, negatives)
        return Encoded(SDConditioning(positive), SDConditioning(negative) if cfg else None)

    def forward(self, latents, timesteps, cond, guidance, width, height):
        return self.pipe.unet(latents, timesteps, encoder_hidden_states=cond.prompt_embeds,
                              return_dict=False)[0]

    # The SD-style pipelines' helpers (SDXL's edit pipelines share these signatures).

    def noise_latents(self, k, width, height, dtype, generators):
        return self.pipe.prepare_latents(k, self.pipe.unet.config.in_channels, height, width,
                                         dtype, self.device, generators)

    def mask_latents(self, pipe, condition, masked_image, k, width, height, dtype, generators):
        mask, _ = pipe.prepare_mask_latents(condition, masked_image, k, height, width, dtype,
                                            self.device, generators, False)
        return mask
