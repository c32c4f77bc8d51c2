"""FLUX.1 Kontext: Flux whose edits put the input image's latent tokens beside the generated
ones (their position ids on a second frame), so every row attends to its own request's image.

The pipeline fixes the output size by area (``max_area``, 1024x1024 unless told) and by default
resizes the input to one of its preferred resolutions; the server asks for the size it validated
and fits the input to it, so a request equals the pipeline called with ``max_area = width x
height`` and ``_auto_resize=False``. Guidance is Flux's embedding (no CFG pass).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from diffserve.executor.families.base import BY_AREA
from diffserve.executor.families.conditioning import padded
from diffserve.executor.families.row_sizes import RowSizes, joined_rows
from diffserve.executor.families.flux.step import Flux, FluxConditioning
from diffserve.executor.families.reference_batch import TogetherReferences


@dataclass
class KontextConditioning(FluxConditioning):
    # An edit's reference image, packed into tokens: one row per image (padded to the longest
    # where rows of several sizes share a forward).
    image_latents: Any = padded(None, rounded=False)


class FluxKontext(TogetherReferences, Flux):
    name = "flux-kontext"
    mixes_references = True  # each row's reference tokens after its own, padded per row
    pipelines = ("FluxKontextPipeline",)
    max_references = 1  # the pipeline takes one input image
    reference_call = BY_AREA
    strength_pipelines = {}  # its edits are by instruction (diffusers' Kontext inpainting is not run)

    def encode(self, prompts, negatives, cfg):
        encoded = super().encode(prompts, negatives, cfg)
        return type(encoded)(KontextConditioning(**vars(encoded.positive)))

    def noise_latents(self, k, width, height, dtype, generators):
        return self.pipe.prepare_latents(None, k, self._channels, height, width, dtype,
                                         self.device, generators)[0]

    def reference_tensor(self, reference, width, height, dtype):
        return self.image_tensor(self.pipe, reference, width, height).to(self.device, dtype)

    def reference_conditioning(self, references, width, height, k, dtype, generators):
        (reference,) = references
        pipe = self.pipe
        latents = self.reference_latents(reference, width, height, dtype)  # the mode
        h, w = latents.shape[2:]
        packed = pipe._pack_latents(latents, 1, self._channels, h, w)
        return {"image_latents": packed.repeat(k, 1, 1)}

    def forward(self, latents, timesteps, cond, guidance, width, height, sizes=None):
        if cond.image_latents is None:
            return super().forward(latents, timesteps, cond, guidance, width, height, sizes=sizes)
        # The reference has the output's size (the server fits it), so its ids are the
        # generated tokens' on the next frame; the answer is the generated tokens' part.
        hidden = self.torch.cat([latents, cond.image_latents], dim=1)
        rows, mixed = sizes, sizes is not None
        if mixed:  # each row: its own tokens, its reference's, then padding
            rows = RowSizes(sizes.sizes, tuple(2 * t for t in sizes.tokens), 2 * sizes.length)
            hidden = joined_rows([(latents, sizes.tokens), (cond.image_latents, sizes.tokens)],
                                 rows.length)
        transformer = self.pipe.transformer
        with self._rows_attention(rows, cond, self._edit_ids, "edit") if mixed else nullcontext():
            out = transformer(
                hidden_states=hidden, timestep=timesteps.to(latents.dtype) / 1000,
                guidance=guidance if transformer.config.guidance_embeds else None,
                encoder_hidden_states=cond.prompt_embeds,
                pooled_projections=cond.pooled_projections, txt_ids=cond.text_ids,
                img_ids=self._edit_ids(*self._longest(sizes) if mixed else (width, height)),
                return_dict=False)[0]
        return out[:, :latents.shape[1]]

    def _edit_ids(self, width: int, height: int):
        """An edit row's ids: its image tokens', then its reference's on the next frame."""
        def make():
            ids = self._latent_ids(width, height)
            reference = ids.clone()
            reference[..., 0] = 1
            return self.torch.cat([ids, reference])

        return self._kept(("edit-ids", width, height), make)

    def request_kwargs(self, task, width, height, references=None):
        kwargs = super().request_kwargs(task, width, height, references)
        kwargs["max_area"] = width * height
        if references:
            kwargs["_auto_resize"] = False
        return kwargs


FAMILIES = (FluxKontext,)
