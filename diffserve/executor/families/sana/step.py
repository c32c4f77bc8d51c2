"""Sana: a linear-attention DiT over a deep-compression autoencoder's latents, with cross-attention
to a Gemma2 text encoder (prompts padded to a fixed length and masked, positive prompts led by the
pipeline's instruction)."""

from __future__ import annotations

import inspect
from typing import Any

from diffserve.executor.families.blocks import CROSS
from diffserve.executor.families.conditioning import Encoded
from diffserve.executor.families.pixart.step import MaskedTextConditioning, PixArtSigma


class Sana(PixArtSigma):
    name = "sana"
    # Its MLP convolves each token with its neighbours in the grid, so padding cells beside a
    # row's image would reach it: one size a forward.
    mixes_sizes = False
    mixes_in_grid = False
    pipelines = ("SanaPipeline",)
    block_lists = {"SanaTransformer2DModel": ("transformer_blocks",)}
    block_kinds = {"SanaTransformerBlock": CROSS}

    def _encode_kwargs(self) -> dict[str, Any]:
        # The instruction the pipeline puts before every positive prompt by default.
        default = inspect.signature(self.pipe.__call__).parameters["complex_human_instruction"].default
        return {**super()._encode_kwargs(),
                "complex_human_instruction": self.call_kwargs.get("complex_human_instruction",
                                                                  default)}

    def encode(self, prompts, negatives, cfg):
        positive, mask, negative, negative_mask = self.pipe.encode_prompt(
            prompts, cfg, negative_prompt=negatives if negatives is not None else "",
            num_images_per_prompt=1, device=self.device, **self._encode_kwargs())
        return Encoded(MaskedTextConditioning(positive, mask),
                       MaskedTextConditioning(negative, negative_mask) if cfg else None)

    def forward(self, latents, timesteps, cond, guidance, width, height):
        transformer = self.pipe.transformer
        out = transformer(
            latents.to(transformer.dtype), encoder_hidden_states=cond.prompt_embeds.to(transformer.dtype),
            encoder_attention_mask=cond.prompt_attention_mask,
            timestep=timesteps * transformer.config.timestep_scale, return_dict=False)[0].float()
        return self._drop_learned_sigma(out, latents)

    def noise_latents(self, k, width, height, dtype, generators):
        # The pipeline keeps its latents in float32, whatever the weights' dtype.
        return self.pipe.prepare_latents(k, self.pipe.transformer.config.in_channels, height,
                                         width, self.torch.float32, self.device, generators)


FAMILIES = (Sana,)
