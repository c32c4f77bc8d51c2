"""Flux: an MM-DiT over packed flow-matching latents, CLIP and T5, guidance as an embedding
(no classifier-free guidance pass)."""

from __future__ import annotations

import numpy as np

from diffserve.executor.families.base import Conditioning, Family, Prepared, scheduler_swapped
from diffserve.protocol import EDIT, GENERATE


class Flux(Family):
    name = "flux"
    pipelines = ("FluxPipeline",)
    flow_matching = True

    def __init__(self, pipe, edits, call_kwargs) -> None:
        super().__init__(pipe, edits, call_kwargs)
        self._text_ids = None
        self._image_ids: dict[tuple[int, int], object] = {}

    def uses_cfg(self, guidance_scale: float) -> bool:
        return False  # guidance is an input of the transformer; negative prompts are not used

    def encode(self, prompts, negatives, cfg):
        positive, pooled, text_ids = self.pipe.encode_prompt(
            prompts, None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.call_kwargs.get("max_sequence_length", 512))
        self._text_ids = text_ids  # the same for every prompt of this model
        return Conditioning({"encoder_hidden_states": positive, "pooled_projections": pooled})

    def _latent_ids(self, width: int, height: int):
        key = (width, height)
        if key not in self._image_ids:
            pipe = self.pipe
            lat_h = 2 * (height // (pipe.vae_scale_factor * 2))
            lat_w = 2 * (width // (pipe.vae_scale_factor * 2))
            self._image_ids[key] = pipe._prepare_latent_image_ids(
                1, lat_h // 2, lat_w // 2, self.device, self.dtype)
        return self._image_ids[key]

    def forward(self, latents, timesteps, cond, guidance, width, height):
        transformer = self.pipe.transformer
        return transformer(
            hidden_states=latents, timestep=timesteps.to(latents.dtype) / 1000,
            guidance=guidance if transformer.config.guidance_embeds else None,
            txt_ids=self._text_ids, img_ids=self._latent_ids(width, height), return_dict=False,
            **cond)[0]

    def decode(self, latents, width, height, task=GENERATE):
        pipe, vae = self.pipe, self.pipe.vae
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        return self._postprocess(vae.decode(latents, return_dict=False)[0])

    def _schedule(self, scheduler, steps: int, width: int, height: int):
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        config = scheduler.config
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        scale = self.pipe.vae_scale_factor
        seq_len = (height // scale // 2) * (width // scale // 2)
        mu = calculate_shift(seq_len, config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        return retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)[0]

    def prepare(self, task, scheduler, steps, strength, width, height, generators, cond_dtype,
                image=None, mask=None):
        k = len(generators)
        channels = self.pipe.transformer.config.in_channels // 4
        if task == GENERATE:
            latents, _ = self.pipe.prepare_latents(k, channels, height, width, cond_dtype,
                                                   self.device, generators)
            timesteps = self._schedule(scheduler, steps, width, height)
            scheduler.set_begin_index(0)
            return Prepared(timesteps, latents)
        pipe = self.edits[task]
        init = self._image_tensor(pipe, image, width, height).to(dtype=self.torch.float32)
        init = init.repeat(k, 1, 1, 1)
        with scheduler_swapped(pipe, scheduler):
            timesteps = self._edit_schedule(pipe, scheduler, steps, strength, width, height)
            start = timesteps[:1].repeat(k)
            if task == EDIT:
                latents, _ = pipe.prepare_latents(init, start, k, channels, height, width,
                                                  cond_dtype, self.device, generators)
                return Prepared(timesteps, latents)
            latents, noise, image_latents, _ = pipe.prepare_latents(
                init, start, k, channels, height, width, cond_dtype, self.device, generators)
            condition = self._mask_tensor(pipe, mask, width, height).repeat(k, 1, 1, 1)
            mask_latents, _ = pipe.prepare_mask_latents(
                condition, init * (condition < 0.5), k, channels, 1, height, width, cond_dtype,
                self.device, generators)
            return Prepared(timesteps, latents, blend={"mask": mask_latents,
                                                       "image_latents": image_latents, "noise": noise})
