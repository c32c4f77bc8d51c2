"""PixArt-Sigma: a DiT with cross-attention to T5 (prompts padded to a fixed length and masked),
trained with learned variance: the second half of its output channels is not used to denoise."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from diffserve.executor.families.blocks import CROSS
from diffserve.executor.families.base import Family
from diffserve.executor.families.conditioning import Conditioning, Encoded, padded
from diffserve.executor.families.patched_rows import grid_valid, patched_per_row


@dataclass
class MaskedTextConditioning(Conditioning):
    prompt_embeds: Any = padded()
    prompt_attention_mask: Any = padded()


class PixArtSigma(Family):
    name = "pixart-sigma"
    # Each row patchified at its own size and laid out in the union grid; its self-attention
    # takes a key mask of its own (diffserve.executor.families.patched_rows).
    mixes_sizes = True
    mixes_in_grid = True
    pipelines = ("PixArtSigmaPipeline",)
    block_lists = {"PixArtTransformer2DModel": ("transformer_blocks",)}
    block_kinds = {"BasicTransformerBlock": CROSS}

    def _encode_kwargs(self) -> dict[str, Any]:
        return {"clean_caption": self.call_kwargs.get("clean_caption", False),
                "max_sequence_length": self.call_kwargs.get("max_sequence_length", 300)}

    def encode(self, prompts, negatives, cfg):
        # Without a negative prompt the pipeline guides against "" (its default), as here.
        positive, mask, negative, negative_mask = self.pipe.encode_prompt(
            prompts, cfg, negatives if negatives is not None else "", 1, self.device,
            **self._encode_kwargs())
        return Encoded(MaskedTextConditioning(positive, mask),
                       MaskedTextConditioning(negative, negative_mask) if cfg else None)

    def forward(self, latents, timesteps, cond, guidance, width, height, sizes=None):
        transformer, mask = self.pipe.transformer, None
        grid = nullcontext()
        if sizes is not None:  # rows of several sizes in one grid: its other cells masked
            sides, valid = self._grid_of(sizes)
            grid = patched_per_row(self.torch, transformer.pos_embed, sides, valid)
            mask = valid.to(latents.dtype)  # the transformer makes it a bias on self-attention
        with grid:
            out = transformer(
                latents, encoder_hidden_states=cond.prompt_embeds, attention_mask=mask,
                encoder_attention_mask=cond.prompt_attention_mask, timestep=timesteps,
                added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                return_dict=False)[0]
        return self._drop_learned_sigma(out, latents)

    def row_tokens(self, latents) -> int:
        patch = self.pipe.transformer.config.patch_size
        return super().row_tokens(latents) // (patch * patch)

    def _grid_of(self, sizes):
        """Each row's latent (h, w) and the grid's valid cells (patched_rows)."""
        scale, patch = self.pipe.vae_scale_factor, self.pipe.transformer.config.patch_size
        sides = [(h // scale, w // scale) for w, h in sizes.sizes]
        return sides, self._kept(("grid", tuple(sides)), lambda: grid_valid(
            self.torch, sides, patch, self.device))

    @staticmethod
    def _drop_learned_sigma(out, latents):
        """Models trained with learned variance predict it in extra channels; guidance and the
        scheduler step use the noise half only (the pipeline does the same, after guidance,
        which per channel is the same thing)."""
        return out[:, :latents.shape[1]] if out.shape[1] == 2 * latents.shape[1] else out

    def noise_latents(self, k, width, height, dtype, generators):
        return self.pipe.prepare_latents(k, self.pipe.transformer.config.in_channels, height,
                                         width, dtype, self.device, generators)


FAMILIES = (PixArtSigma,)
