"""Stable Diffusion XL: a UNet with added text and size conditioning, two CLIP text encoders."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from diffserve.executor.families.conditioning import Conditioning, Encoded
from diffserve.executor.families.sd.step import StableDiffusion
from diffserve.executor.families.sdxl import controls
from diffserve.wire.tasks import IMAGE_TO_IMAGE, INPAINT


@dataclass
class SDXLConditioning(Conditioning):
    prompt_embeds: Any
    text_embeds: Any  # the pooled prompt
    time_ids: Any = None  # the size conditioning, set per request at admission


class StableDiffusionXL(StableDiffusion):
    name = "stable-diffusion-xl"
    pipelines = ("StableDiffusionXLPipeline",)
    strength_pipelines = {IMAGE_TO_IMAGE.name: "StableDiffusionXLImg2ImgPipeline",
                          INPAINT.name: "StableDiffusionXLInpaintPipeline"}
    begins_at_index_zero = True

    def encode(self, prompts, negatives, cfg):
        positive, negative, pooled, negative_pooled = self.pipe.encode_prompt(
            prompts, device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=cfg,
            negative_prompt=negatives)
        return Encoded(SDXLConditioning(positive, pooled),
                       SDXLConditioning(negative, negative_pooled) if cfg else None)

    control_pipelines = controls.PIPELINES  # the rest of its ControlNet tables are SD's
    control_stacks = controls.STACKS

    def forward(self, latents, timesteps, cond, guidance, width, height, control=None):
        return self.pipe.unet(latents, timesteps, encoder_hidden_states=cond.prompt_embeds,
                              **self.unet_conditions(cond), **self.unet_residuals(control),
                              return_dict=False)[0]

    def unet_conditions(self, cond) -> dict:
        return {"added_cond_kwargs": {"text_embeds": cond.text_embeds, "time_ids": cond.time_ids}}

    def request_conditioning(self, task, width, height, encoded):
        dtype, size = encoded.positive.dtype, (height, width)
        if task.from_image:  # the edit pipelines add aesthetic scores where the model has them
            positive, negative = self.pipelines[task.name]._get_add_time_ids(
                size, (0, 0), size, 6.0, 2.5, size, (0, 0), size, dtype=dtype,
                text_encoder_projection_dim=self._projection_dim())
        else:
            positive = negative = self.pipe._get_add_time_ids(
                size, (0, 0), size, dtype=dtype, text_encoder_projection_dim=self._projection_dim())
        k = encoded.positive.prompt_embeds.shape[0]
        with_ids = lambda cond, ids: dataclasses.replace(  # noqa: E731
            cond, time_ids=ids.to(self.device).repeat(k, 1))
        return (with_ids(encoded.positive, positive),
                with_ids(encoded.negative, negative) if encoded.negative is not None else None)

    def _projection_dim(self) -> int:
        encoder = self.pipe.text_encoder_2
        return int(encoder.config.projection_dim) if encoder is not None else int(
            self.pipe.unet.config.projection_class_embeddings_input_dim)

    def vae_latents(self, latents, task):
        torch, vae = self.torch, self.pipe.vae
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is None or std is None:
            return latents / vae.config.scaling_factor
        shape = (1, len(mean), 1, 1)
        mean = torch.tensor(mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(std).view(shape).to(latents.device, latents.dtype)
        return latents * std / vae.config.scaling_factor + mean

    def decode(self, latents, width, height, task):
        torch, vae = self.torch, self.pipe.vae
        if not (vae.dtype == torch.float16 and vae.config.force_upcast):
            return super().decode(latents, width, height, task)
        # fp16 SDXL VAEs overflow: as the pipeline does, decode in float32, then go back.
        self.pipe.upcast_vae()
        try:
            latents = latents.to(next(iter(vae.post_quant_conv.parameters())).dtype)
            return super().decode(latents, width, height, task)
        finally:
            vae.to(dtype=torch.float16)


FAMILIES = (StableDiffusionXL,)
