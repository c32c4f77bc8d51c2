"""Z-Image: a single-stream DiT over flow-matching latents conditioned on a Qwen3 text encoder.
Its transformer takes lists, one tensor a row, so every row keeps its own caption length: the
captions travel padded between rows and are cut back to each row's own tokens for the forward.

Its pipeline's conventions differ from the other flow-matching ones: the transformer is given
``(1000 - t) / 1000`` and predicts the negated velocity; guidance counts from 0 (a negative pass
for any scale above 0, ``pos + g (pos - neg)``), optionally capped at a multiple of the
conditional prediction's norm (``cfg_normalization``); its sigmas are a float32 torch linspace,
which differs from numpy's in the last bit for most step counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffserve.wire.costs import ABOVE_ZERO
from diffserve.executor.families.blocks import BlockKind
from diffserve.executor.families.conditioning import Conditioning, Encoded, on_host, padded
from diffserve.executor.families.packed_flow import PackedFlow
from diffserve.executor.families.row_sizes import padded_rows
from diffserve.wire.tasks import IMAGE_TO_IMAGE, INPAINT

SEQUENCE_MULTIPLE = 32  # the transformer pads each stream of a row to a multiple of this


@dataclass
class ZImageConditioning(Conditioning):
    prompt_embeds: Any = padded()  # [rows, longest caption, D]
    prompt_lengths: tuple[int, ...] = on_host()  # each row's own caption length

    def captions(self) -> list:
        return [embeds[:n] for embeds, n in zip(self.prompt_embeds, self.prompt_lengths)]

    def prompt_tensors(self):
        return {"prompt_embeds": self.captions()[0]}


class ZImage(PackedFlow):
    """The latents stay [k, C, h, w] (the transformer patchifies them itself), so the packing
    steps are the identity; the edit pipelines' helpers share PackedFlow's signatures."""

    name = "z-image"
    pipelines = ("ZImagePipeline",)
    strength_pipelines = {IMAGE_TO_IMAGE.name: "ZImageImg2ImgPipeline",
                          INPAINT.name: "ZImageInpaintPipeline"}
    # Its refiners run before the main stack on the two streams apart: the first block that
    # sees them joined is the main stack's.
    block_lists = {"ZImageTransformer2DModel": ("layers",)}
    block_kinds = {"ZImageTransformerBlock": BlockKind(hidden="x")}
    guidance_rule = ABOVE_ZERO
    mixes_sizes = True  # its transformer takes a list of rows, each its own size

    def __init__(self, pipe, pipelines, call_kwargs) -> None:
        super().__init__(pipe, pipelines, call_kwargs)
        if float(call_kwargs.get("cfg_truncation", 1.0)) < 1:
            # It switches guidance off by timestep, which guide() is not told.
            raise ValueError("the step engine does not run Z-Image with cfg_truncation below 1; "
                             "use --batching-mode request")

    @property
    def _channels(self) -> int:
        return self.pipe.transformer.config.in_channels

    def encode(self, prompts, negatives, cfg):
        # encode_prompt writes the templated prompts into the lists it is given: pass copies.
        positive, negative = self.pipe.encode_prompt(
            list(prompts), self.device, do_classifier_free_guidance=cfg,
            negative_prompt=None if negatives is None else list(negatives),
            max_sequence_length=self.call_kwargs.get("max_sequence_length", 512))
        return Encoded(self._stacked(positive), self._stacked(negative) if cfg else None)

    def _stacked(self, captions: list) -> ZImageConditioning:
        return ZImageConditioning(self.torch.nn.utils.rnn.pad_sequence(captions, batch_first=True),
                                  tuple(len(c) for c in captions))

    def schedule(self, scheduler, steps, width, height):
        from diffusers.pipelines.z_image.pipeline_z_image import (get_default_z_image_sigmas,
                                                                  retrieve_timesteps)

        # mu only counts where the scheduler shifts dynamically (Z-Image-Turbo's does not).
        return retrieve_timesteps(scheduler, steps, self.device,
                                  sigmas=get_default_z_image_sigmas(steps),
                                  mu=self.shift(scheduler, width, height, self.patch))[0]

    def noise_latents(self, k, width, height, dtype, generators):
        # The pipeline keeps its latents in float32, whatever the weights' dtype.
        return super().noise_latents(k, width, height, self.torch.float32, generators)

    def mask_latents(self, pipe, condition, masked_image, k, width, height, dtype, generators):
        return pipe.prepare_mask_latents(condition, masked_image, k, height, width, dtype,
                                         self.device, generators)[0]

    def forward(self, latents, timesteps, cond, guidance, width, height, sizes=None):
        transformer = self.pipe.transformer
        rows = list(latents.to(transformer.dtype).unsqueeze(2).unbind(0))  # a frame axis each
        mixed = sizes is not None  # rows of several sizes, padded
        if mixed:  # each row cut to its own size: the transformer pads and masks them itself
            sides = [self._latent_sides(*size) for size in sizes.sizes]
            rows = [row[:, :, :h, :w] for row, (h, w) in zip(rows, sides)]
        out = transformer(rows, (1000 - timesteps) / 1000, cond.captions(), return_dict=False)[0]
        # The pipeline negates after guidance; negating first gives the same bits (guidance is
        # linear, its norm cap sign-blind) and hands a rollout's sampler the velocity.
        if mixed:
            return -padded_rows(self.torch, [row.float().squeeze(1)[None] for row in out])
        return -self.torch.stack([row.float() for row in out]).squeeze(2)

    def _latent_sides(self, width: int, height: int) -> tuple[int, int]:
        """(h, w) of an image's latents, as the pipeline makes them."""
        scale = self.pipe.vae_scale_factor * 2
        return 2 * (height // scale), 2 * (width // scale)

    def guide(self, uncond, cond, scale):
        guided = cond + scale * (cond - uncond)
        cap = float(self.call_kwargs.get("cfg_normalization") or 0.0)
        if cap <= 0:
            return guided
        norm = self.torch.linalg.vector_norm
        rows = []
        for positive, row in zip(cond, guided):  # per image, as the pipeline caps it
            ceiling, length = norm(positive) * cap, norm(row)
            rows.append(row * (ceiling / length) if length > ceiling else row)
        return self.torch.stack(rows)

    def cache_tokens(self, width, height):
        # The main stack's sequence is the image's tokens (padded to a multiple of 32 with a
        # pad token of their own), then the caption's, padded to the forward's longest.
        scale = self.pipe.vae_scale_factor
        tokens = (height // scale // self.patch) * (width // scale // self.patch)
        return -(-tokens // SEQUENCE_MULTIPLE) * SEQUENCE_MULTIPLE

    def unpack(self, latents, width, height):
        return latents

    def vae_latents(self, latents, task):
        config = self.pipe.vae.config
        return latents.to(self.pipe.vae.dtype) / config.scaling_factor + config.shift_factor


FAMILIES = (ZImage,)
