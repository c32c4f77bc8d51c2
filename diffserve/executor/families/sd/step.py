"""Stable Diffusion 1.x/2.x: a UNet over 4-channel latents, one CLIP text encoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffserve.executor.families.base import Family
from diffserve.executor.families.conditioning import Conditioning, Encoded
from diffserve.executor.families.sd import controls
from diffserve.wire.tasks import IMAGE_TO_IMAGE, INPAINT


@dataclass
class SDConditioning(Conditioning):
    prompt_embeds: Any


class StableDiffusion(Family):
    name = "stable-diffusion"
    published_dtype = "float16"  # SD 1.x/2.x and SDXL (a subclass) are published in float16
    pipelines = ("StableDiffusionPipeline",)
    strength_pipelines = {IMAGE_TO_IMAGE.name: "StableDiffusionImg2ImgPipeline",
                          INPAINT.name: "StableDiffusionInpaintPipeline"}
    control_classes = controls.CLASSES
    control_config_keys = ("cross_attention_dim", "block_out_channels", "addition_embed_type")
    denoiser_noun = "UNet"
    control_pipelines = controls.PIPELINES
    control_multi = controls.MULTI
    control_image_kwarg = controls.IMAGE_KWARG
    control_stacks = controls.STACKS

    def encode(self, prompts, negatives, cfg):
        positive, negative = self.pipe.encode_prompt(prompts, self.device, 1, cfg, negatives)
        return Encoded(SDConditioning(positive), SDConditioning(negative) if cfg else None)

    def forward(self, latents, timesteps, cond, guidance, width, height, control=None):
        return self.pipe.unet(latents, timesteps, encoder_hidden_states=cond.prompt_embeds,
                              **self.unet_residuals(control), return_dict=False)[0]

    # -- ControlNet: each row's residuals from its own inputs, added to the UNet's skip
    # connections and its mid block.

    def control_condition(self, module, image, width, height, k, dtype, generators):
        from diffusers.image_processor import VaeImageProcessor
        from PIL import Image

        processor = VaeImageProcessor(vae_scale_factor=self.pipe.vae_scale_factor,
                                      do_convert_rgb=True, do_normalize=False)
        pixels = processor.preprocess(Image.fromarray(image), height=height, width=width)
        return pixels.to(dtype=self.torch.float32).repeat_interleave(k, dim=0).to(
            self.device, module.dtype)

    def control_call(self, module, latents, timesteps, cond, guidance, control_cond, modes,
                     width, height):
        down, mid = module(latents, timesteps, encoder_hidden_states=cond.prompt_embeds,
                           controlnet_cond=control_cond, conditioning_scale=1.0,
                           **self.unet_conditions(cond), return_dict=False)
        return list(down), [mid]

    def unet_conditions(self, cond) -> dict:
        """What the UNet and its ControlNets take beside the prompt (SDXL: its added ones)."""
        return {}

    @staticmethod
    def unet_residuals(control) -> dict:
        if control is None:
            return {}
        down, (mid,) = control
        return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}

    # The SD-style pipelines' helpers (SDXL's edit pipelines share these signatures).

    def noise_latents(self, k, width, height, dtype, generators):
        return self.pipe.prepare_latents(k, self.pipe.unet.config.in_channels, height, width,
                                         dtype, self.device, generators)

    def mask_latents(self, pipe, condition, masked_image, k, width, height, dtype, generators):
        mask, _ = pipe.prepare_mask_latents(condition, masked_image, k, height, width, dtype,
                                            self.device, generators, False)
        return mask


FAMILIES = (StableDiffusion,)
