"""Stable Diffusion 3: an MM-DiT over flow-matching latents, two CLIP encoders and T5."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from diffserve.executor.families.blocks import JOINT
from diffserve.executor.families.base import Family
from diffserve.executor.families.conditioning import Conditioning, Encoded
from diffserve.executor.families.patched_rows import grid_valid, patched_per_row
from diffserve.executor.families.row_sizes import processors_swapped
from diffserve.executor.families.sd3 import rows
from diffserve.wire.tasks import IMAGE_TO_IMAGE, INPAINT


@dataclass
class SD3Conditioning(Conditioning):
    prompt_embeds: Any
    pooled_projections: Any

    def prompt_tensors(self):
        return {"prompt_embeds": self.prompt_embeds[0],
                "pooled_prompt_embeds": self.pooled_projections[0]}


class StableDiffusion3(Family):
    name = "stable-diffusion-3"
    pipelines = ("StableDiffusion3Pipeline",)
    strength_pipelines = {IMAGE_TO_IMAGE.name: "StableDiffusion3Img2ImgPipeline",
                          INPAINT.name: "StableDiffusion3InpaintPipeline"}
    block_lists = {"SD3Transformer2DModel": ("transformer_blocks",)}
    block_kinds = {"JointTransformerBlock": JOINT}  # its last block returns no text stream
    max_shift = 1.16  # its pipeline's default, where Flux's is 1.15
    mixes_sizes = True  # each row patchified at its own size, laid out in the union grid
    mixes_in_grid = True

    def encode(self, prompts, negatives, cfg):
        positive, negative, pooled, negative_pooled = self.pipe.encode_prompt(
            prompts, None, None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=cfg, negative_prompt=negatives,
            max_sequence_length=self.call_kwargs.get("max_sequence_length", 256))
        return Encoded(SD3Conditioning(positive, pooled),
                       SD3Conditioning(negative, negative_pooled) if cfg else None)

    def forward(self, latents, timesteps, cond, guidance, width, height, sizes=None):
        transformer = self.pipe.transformer
        with self._rows_in_grid(sizes) if sizes is not None else nullcontext():
            return transformer(hidden_states=latents, timestep=timesteps,
                               encoder_hidden_states=cond.prompt_embeds,
                               pooled_projections=cond.pooled_projections, return_dict=False)[0]

    # -- rows of different sizes in one forward (diffserve.executor.families.patched_rows)

    def row_processors(self):
        return rows.kinds()

    def row_tokens(self, latents) -> int:
        patch = self.pipe.transformer.config.patch_size
        return super().row_tokens(latents) // (patch * patch)

    @contextmanager
    def _rows_in_grid(self, sizes):
        transformer = self.pipe.transformer
        scale, patch = self.pipe.vae_scale_factor, transformer.config.patch_size
        sides = [(h // scale, w // scale) for w, h in sizes.sizes]
        valid = self._kept(("grid", tuple(sides)), lambda: grid_valid(
            self.torch, sides, patch, self.device))
        with (patched_per_row(self.torch, transformer.pos_embed, sides, valid),
              processors_swapped(transformer, rows.kinds(),
                                 lambda inner: rows.RowsProcessor(inner, valid))):
            yield

    def vae_latents(self, latents, task):
        vae = self.pipe.vae
        latents = latents / vae.config.scaling_factor
        # diffusers' SD3 inpainting pipeline decodes without the shift; results follow it.
        return latents if task.masked else latents + vae.config.shift_factor

    def schedule(self, scheduler, steps, width, height):
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            kwargs["mu"] = self.shift(scheduler, width, height,
                                      self.pipe.transformer.config.patch_size)
        return retrieve_timesteps(scheduler, steps, self.device, sigmas=None, **kwargs)[0]

    def noise_latents(self, k, width, height, dtype, generators):
        return self.pipe.prepare_latents(k, self.pipe.transformer.config.in_channels, height,
                                         width, dtype, self.device, generators)

    def mask_latents(self, pipe, condition, masked_image, k, width, height, dtype, generators):
        mask, _ = pipe.prepare_mask_latents(condition, masked_image, k, 1, height, width, dtype,
                                            self.device, generators, False)
        return mask


FAMILIES = (StableDiffusion3,)
