"""Stable Diffusion 1.x/2.x: a UNet over 4-channel latents, one CLIP text encoder."""

from __future__ import annotations

from diffserve.executor.families.base import Conditioning, Family, Prepared, scheduler_swapped
from diffserve.protocol import EDIT, GENERATE, INPAINT


class StableDiffusion(Family):
    name = "stable-diffusion"
    pipelines = ("StableDiffusionPipeline",)

    def encode(self, prompts, negatives, cfg):
        positive, negative = self.pipe.encode_prompt(
            prompts, self.device, 1, cfg, negatives)
        return Conditioning({"encoder_hidden_states": positive},
                            {"encoder_hidden_states": negative} if cfg else None)

    def forward(self, latents, timesteps, cond, guidance, width, height):
        return self.pipe.unet(latents, timesteps, return_dict=False, **cond)[0]

    def decode(self, latents, width, height, task=GENERATE):
        vae = self.pipe.vae
        image = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
        return self._postprocess(image)

    # -- preparation, in the order of the family's own pipelines --------------------------

    def prepare(self, task, scheduler, steps, strength, width, height, generators, cond_dtype,
                image=None, mask=None):
        if task == GENERATE:
            return self._prepare_generate(scheduler, steps, width, height, generators, cond_dtype)
        if task == EDIT:
            return self._prepare_edit(scheduler, steps, strength, generators, cond_dtype, image,
                                      width, height)
        return self._prepare_inpaint(scheduler, steps, strength, width, height, generators,
                                     cond_dtype, image, mask)

    def _prepare_generate(self, scheduler, steps, width, height, generators, cond_dtype) -> Prepared:
        pipe, k = self.pipe, len(generators)
        timesteps = self._schedule(scheduler, steps, width, height)
        with scheduler_swapped(pipe, scheduler):
            latents = pipe.prepare_latents(k, pipe.unet.config.in_channels, height, width,
                                           cond_dtype, self.device, generators)
            return Prepared(timesteps, latents, pipe.prepare_extra_step_kwargs(generators, 0.0))

    def _prepare_edit(self, scheduler, steps, strength, generators, cond_dtype, image, width,
                      height) -> Prepared:
        pipe, k = self.edits[EDIT], len(generators)
        init = self._image_tensor(pipe, image, width, height).repeat(k, 1, 1, 1)
        with scheduler_swapped(pipe, scheduler):
            timesteps = self._edit_schedule(pipe, scheduler, steps, strength, width, height)
            latents = pipe.prepare_latents(init, timesteps[:1].repeat(k), k, 1, cond_dtype,
                                           self.device, generators)
            return Prepared(timesteps, latents, pipe.prepare_extra_step_kwargs(generators, 0.0))

    def _prepare_inpaint(self, scheduler, steps, strength, width, height, generators, cond_dtype,
                         image, mask) -> Prepared:
        pipe, k = self.edits[INPAINT], len(generators)
        with scheduler_swapped(pipe, scheduler):
            timesteps = self._edit_schedule(pipe, scheduler, steps, strength, width, height)
            init = self._image_tensor(pipe, image, width, height).repeat(k, 1, 1, 1)
            init = init.to(dtype=self.torch.float32)
            latents, noise, image_latents = pipe.prepare_latents(
                k, pipe.vae.config.latent_channels, height, width, cond_dtype, self.device,
                generators, None, image=init, timestep=timesteps[:1].repeat(k),
                is_strength_max=strength == 1.0, return_noise=True, return_image_latents=True)
            condition = self._mask_tensor(pipe, mask, width, height).repeat(k, 1, 1, 1)
            mask_latents, _ = pipe.prepare_mask_latents(condition, init * (condition < 0.5), k,
                                                        height, width, cond_dtype, self.device,
                                                        generators, False)
            return Prepared(timesteps, latents, pipe.prepare_extra_step_kwargs(generators, 0.0),
                            blend={"mask": mask_latents, "image_latents": image_latents,
                                   "noise": noise})
