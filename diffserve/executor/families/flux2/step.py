"""FLUX.2: an MM-DiT over latents patchified 2x2 by the VAE itself and normalised with its
batch-norm statistics; the prompt is three hidden-state layers of a language model, padded to a
fixed length with no mask. [dev] takes guidance as an embedding (no negative prompt); [klein]
has none and guides by classifier-free guidance against the empty prompt, unless step-distilled.

Edits condition on reference images: their latents join every row's tokens, each image at its
own time coordinate (10, 20, ...), and only the generated tokens' output is kept. The
transformer takes one set of position ids for all rows, which the batch key makes valid: rows of
one forward share the output size and the number of references (so the references' geometry),
and every prompt has the same padded length.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from diffserve.wire.costs import ABOVE_ONE, NEVER
from diffserve.executor.families.conditioning import Conditioning, Encoded, shared
from diffserve.executor.families.flux2 import rows
from diffserve.executor.families.packed_flow import PackedFlow
from diffserve.executor.families.row_sizes import processors_swapped

# The area (pixels) the pipelines shrink a larger reference image to before encoding it.
REFERENCE_AREA = 1024 * 1024


@dataclass
class Flux2Conditioning(Conditioning):
    prompt_embeds: Any
    text_ids: Any = shared()  # (L, 4): every prompt is padded to the same length
    reference_latents: Any = None  # edits: (rows, reference tokens, C)
    reference_ids: Any = shared()  # edits: (reference tokens, 4), the same for the whole set

    def prompt_tensors(self):
        # No mask leaves the encoder: the padding is part of what the transformer attends to.
        return {"prompt_embeds": self.prompt_embeds[0]}


def _language_model(text_encoder):
    """The encoder without its vocabulary head (the pipelines read hidden states only; a real
    head is 131k/151k wide over 512 tokens a prompt)."""
    return getattr(text_encoder, "model", text_encoder)


class Flux2(PackedFlow):
    name = "flux2"
    pipelines = ("Flux2Pipeline",)
    guidance_rule = NEVER  # guidance is an embedding; the pipeline takes no negative prompt
    mixes_sizes = True  # generations (edits' reference tokens keep one size a set)
    # The pipelines set no limit of their own. Each reference adds as many tokens as the image
    # generated (and attention costs their square), so an edit takes at most four.
    max_references = 4
    references_per_row = False  # the pipeline's ``image`` list conditions every row of a call
    text_layers = (10, 20, 30)  # the pipeline's default text_encoder_out_layers

    def _embed(self, prompts: list[str], **kwargs):
        pipe = self.pipe
        return pipe._get_mistral_3_small_prompt_embeds(
            _language_model(pipe.text_encoder), pipe.tokenizer, prompts,
            system_message=pipe.system_message, **kwargs)

    def _conditioning(self, prompts: list[str]) -> Flux2Conditioning:
        embeds = self._embed(
            prompts, device=self.device,
            max_sequence_length=self.call_kwargs.get("max_sequence_length", 512),
            hidden_states_layers=self.call_kwargs.get("text_encoder_out_layers", self.text_layers))
        return Flux2Conditioning(embeds, self.pipe._prepare_text_ids(embeds[:1])[0].to(self.device))

    def encode(self, prompts, negatives, cfg, references=None):
        return Encoded(self._conditioning(prompts))

    def schedule(self, scheduler, steps, width, height):
        """Sigmas from 1 to 1/steps, shifted by the pipeline's empirical ``mu`` of the token
        count and the number of steps."""
        from diffusers.pipelines.flux2.pipeline_flux2 import (
            compute_empirical_mu,
            retrieve_timesteps,
        )

        h, w = self._grid(width, height)
        mu = compute_empirical_mu(h * w, steps)
        sigmas = None if scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        return retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)[0]

    def _grid(self, width: int, height: int) -> tuple[int, int]:
        """The token grid (rows, columns): a token per 2x2 latent cells."""
        cell = 2 * self.pipe.vae_scale_factor
        return height // cell, width // cell

    def _latent_ids(self, width: int, height: int):
        h, w = self._grid(width, height)
        return self._position_ids(width, height, lambda: self.pipe._prepare_latent_ids(
            self.torch.empty(1, 0, h, w))[0].to(self.device))

    def reference_conditioning(self, references, width, height, k, dtype, generators):
        from PIL import Image

        pipe = self.pipe
        processor, cell = pipe.image_processor, 2 * pipe.vae_scale_factor
        images = []
        for array in references:  # as the pipelines prepare their ``image`` list
            image = processor.check_image_input(Image.fromarray(array))
            if image.width * image.height > REFERENCE_AREA:
                image = processor._resize_to_target_area(image, REFERENCE_AREA)
            h, w = image.height // cell * cell, image.width // cell * cell
            images.append(processor.preprocess(image, height=h, width=w, resize_mode="crop"))
        latents, ids = pipe.prepare_image_latents(images, k, generators, self.device, pipe.vae.dtype)
        return {"reference_latents": latents, "reference_ids": ids[0]}

    def forward(self, latents, timesteps, cond, guidance, width, height, sizes=None):
        torch, transformer = self.torch, self.pipe.transformer
        mixed = sizes is not None  # rows of several sizes, padded (generations: no references)
        tokens, ids = latents, self._latent_ids(*self._longest(sizes) if mixed else (width, height))
        if cond.reference_latents is not None:
            tokens = torch.cat([latents, cond.reference_latents], dim=1)
            ids = torch.cat([ids, cond.reference_ids])
        with self._rows_attention(sizes, cond) if mixed else nullcontext():
            out = transformer(
                hidden_states=tokens.to(transformer.dtype),
                timestep=timesteps.to(latents.dtype) / 1000,
                guidance=guidance if transformer.config.guidance_embeds else None,
                encoder_hidden_states=cond.prompt_embeds, txt_ids=cond.text_ids, img_ids=ids,
                return_dict=False)[0]
        return out[:, :latents.shape[1]]

    # -- rows of different sizes in one forward (diffserve.executor.families.row_sizes)

    def row_processors(self):
        return rows.kinds()

    def _rows_attention(self, sizes, cond):
        transformer = self.pipe.transformer
        positions = self._kept(("rows", sizes.sizes, sizes.length), lambda: rows.flux2_rows(
            self.torch, transformer, sizes, cond.text_ids,
            {size: self._latent_ids(*size) for size in sizes.distinct()}))
        return processors_swapped(transformer, rows.kinds(),
                                  lambda inner: rows.processor(inner, positions))

    def unpack(self, latents, width, height):
        """Tokens to the VAE's patchified grid (k, 4C, h, w), in raster order."""
        return latents.reshape(latents.shape[0], *self._grid(width, height), -1).permute(0, 3, 1, 2)

    def image_latents_of(self, latents, width, height):
        return self.pipe._unpatchify_latents(self.unpack(latents, width, height))

    def vae_latents(self, latents, task):
        """Un-normalised with the VAE's batch-norm statistics, then un-patchified."""
        vae, torch = self.pipe.vae, self.torch
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
            latents.device, latents.dtype)
        return self.pipe._unpatchify_latents(latents * std + mean)


class Flux2Klein(Flux2):
    name = "flux2-klein"
    pipelines = ("Flux2KleinPipeline",)
    # Classifier-free guidance above 1, always against "" (the pipeline takes no negative prompt).
    guidance_rule = ABOVE_ONE
    text_layers = (9, 18, 27)

    def __init__(self, pipe, pipelines, call_kwargs) -> None:
        super().__init__(pipe, pipelines, call_kwargs)
        self._empty: Flux2Conditioning | None = None

    def uses_cfg(self, guidance_scale, negative_prompt):
        # Step-distilled checkpoints ignore the guidance scale.
        return (not self.pipe.config.is_distilled
                and super().uses_cfg(guidance_scale, negative_prompt))

    def _embed(self, prompts, **kwargs):
        pipe = self.pipe
        return pipe._get_qwen3_prompt_embeds(_language_model(pipe.text_encoder), pipe.tokenizer,
                                             prompts, **kwargs)

    def encode(self, prompts, negatives, cfg, references=None):
        if cfg and self._empty is None:  # the negative is always "": encoded once
            self._empty = self._conditioning([""])
        return Encoded(self._conditioning(prompts),
                       self._empty.repeat(len(prompts)) if cfg else None)


FAMILIES = (Flux2, Flux2Klein)
