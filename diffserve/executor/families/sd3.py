"""Stable Diffusion 3: an MM-DiT over flow-matching latents, two CLIP encoders and T5."""

from __future__ import annotations

from diffserve.executor.families.base import Conditioning, Family, Prepared, scheduler_swapped
from diffserve.protocol import EDIT, GENERATE, INPAINT


class StableDiffusion3(Family):
    name = "stable-diffusion-3"
    pipelines = ("StableDiffusion3Pipeline",)
    flow_matching = True

    def encode(self, prompts, negatives, cfg):
        positive, negative, pooled, negative_pooled = self.pipe.encode_prompt(
            prompts, None, None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=cfg, negative_prompt=negatives,
            max_sequence_length=self.call_kwargs.get("max_sequence_length", 256))
        return Conditioning({"encoder_hidden_states": positive, "pooled_projections": pooled},
                            {"encoder_hidden_states": negative,
                             "pooled_projections": negative_pooled} if cfg else None)

    def forward(self, latents, timesteps, cond, guidance, width, height):
        return self.pipe.transformer(hidden_states=latents, timestep=timesteps, return_dict=False,
                                     **cond)[0]

    def decode(self, latents, width, height, task=GENERATE):
        vae = self.pipe.vae
        latents = latents / vae.config.scaling_factor
        # diffusers' SD3 inpainting pipeline decodes without the shift; results follow it.
        if task != INPAINT:
            latents = latents + vae.config.shift_factor
        return self._postprocess(vae.decode(latents, return_dict=False)[0])

    def _schedule(self, scheduler, steps: int, width: int, height: int):
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
            calculate_shift,
            retrieve_timesteps,
        )

        kwargs = {}
        config = scheduler.config
        if config.get("use_dynamic_shifting", None):
            patch, scale = self.pipe.transformer.config.patch_size, self.pipe.vae_scale_factor
            seq_len = (height // scale // patch) * (width // scale // patch)
            kwargs["mu"] = calculate_shift(
                seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5), config.get("max_shift", 1.16))
        return retrieve_timesteps(scheduler, steps, self.device, sigmas=None, **kwargs)[0]

    def prepare(self, task, scheduler, steps, strength, width, height, generators, cond_dtype,
                image=None, mask=None):
        k = len(generators)
        if task == GENERATE:
            latents = self.pipe.prepare_latents(k, self.pipe.transformer.config.in_channels, height,
                                                width, cond_dtype, self.device, generators)
            return Prepared(self._schedule(scheduler, steps, width, height), latents)
        pipe = self.edits[task]
        init = self._image_tensor(pipe, image, width, height).repeat(k, 1, 1, 1)
        with scheduler_swapped(pipe, scheduler):
            timesteps = self._edit_schedule(pipe, scheduler, steps, strength, width, height)
            start = timesteps[:1].repeat(k)
            if task == EDIT:
                return Prepared(timesteps, pipe.prepare_latents(init, start, k, 1, cond_dtype,
                                                                self.device, generators))
            init = init.to(dtype=self.torch.float32)
            latents, noise, image_latents = pipe.prepare_latents(
                k, pipe.vae.config.latent_channels, height, width, cond_dtype, self.device,
                generators, None, image=init, timestep=start, is_strength_max=strength == 1.0,
                return_noise=True, return_image_latents=True)
            condition = self._mask_tensor(pipe, mask, width, height).repeat(k, 1, 1, 1)
            mask_latents, _ = pipe.prepare_mask_latents(
                condition, init * (condition < 0.5), k, 1, height, width, cond_dtype, self.device,
                generators, False)
            return Prepared(timesteps, latents, blend={"mask": mask_latents,
                                                       "image_latents": image_latents, "noise": noise})
