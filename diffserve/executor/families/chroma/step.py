"""Chroma: Flux's MM-DiT over packed flow-matching latents without the pooled CLIP input or the
guidance embedding, conditioned on T5 alone, with real classifier-free guidance.

Its pipeline pads every prompt to ``max_sequence_length`` and gives the transformer a float
text mask: 1 for the prompt's tokens and the first padding token, 0 for the rest, then 1 for
every image token. The transformer turns it into a float attention bias (1 where both tokens are
kept, else 0), added to the scores rather than masking any out, so it is reproduced as it is,
row by row; all rows have the same text length, so they stack without padding.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from diffserve.wire.costs import ABOVE_ONE
from diffserve.executor.families.conditioning import Conditioning, Encoded, shared
from diffserve.executor.families.flux.step import Flux


@dataclass
class ChromaConditioning(Conditioning):
    prompt_embeds: Any
    attention_mask: Any  # the pipeline's float text mask, [rows, max_sequence_length]
    text_ids: Any = shared()

    def prompt_tensors(self):
        # All of it: the padding tokens take part in attention (the mask only biases them).
        return {"prompt_embeds": self.prompt_embeds[0]}


class Chroma(Flux):
    name = "chroma"
    pipelines = ("ChromaPipeline",)
    strength_pipelines = {}  # diffusers' auto-pipelines map none for Chroma
    guidance_rule = ABOVE_ONE

    def encode(self, prompts, negatives, cfg):
        # Without a negative prompt the pipeline guides against "" (its default), as here.
        positive, text_ids, mask, negative, _, negative_mask = self.pipe.encode_prompt(
            prompts, negatives, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=cfg,
            max_sequence_length=self.call_kwargs.get("max_sequence_length", 512))
        return Encoded(ChromaConditioning(positive, mask, text_ids),
                       ChromaConditioning(negative, negative_mask, text_ids) if cfg else None)

    def forward(self, latents, timesteps, cond, guidance, width, height, sizes=None):
        pipe = self.pipe
        # Rows of several sizes (padded): the bias as the pipeline makes it over the padded
        # length, the padding then masked out by the per-row processor.
        mask = pipe._prepare_attention_mask(latents.shape[0], latents.shape[1], latents.dtype,
                                            cond.attention_mask)
        mixed = sizes is not None
        with self._rows_attention(sizes, cond) if mixed else nullcontext():
            return pipe.transformer(
                hidden_states=latents, timestep=timesteps.to(latents.dtype) / 1000,
                encoder_hidden_states=cond.prompt_embeds, txt_ids=cond.text_ids,
                img_ids=self._latent_ids(*self._longest(sizes) if mixed else (width, height)),
                attention_mask=mask, return_dict=False)[0]


FAMILIES = (Chroma,)
