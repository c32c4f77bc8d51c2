"""FLUX.1 Kontext: Flux whose edits put the input image's latent tokens beside the generated
ones (their position ids on a second frame), so every row attends to its own request's image.

The pipeline fixes the output size by area (``max_area``, 1024x1024 unless told) and by default
resizes the input to one of its preferred resolutions; the server asks for the size it validated
and fits the input to it, so a request equals the pipeline called with ``max_area = width x
height`` and ``_auto_resize=False``. Guidance is Flux's embedding (no CFG pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffserve.executor.families.base import BY_AREA
from diffserve.executor.families.flux.step import Flux, FluxConditioning
from diffserve.executor.families.reference_batch import TogetherReferences


@dataclass
class KontextConditioning(FluxConditioning):
    image_latents: Any = None  # an edit's reference image, packed into tokens: one row per image


class FluxKontext(TogetherReferences, Flux):
    name = "flux-kontext"
    mixes_sizes = False  # its own forward takes one size (docs/batching.md)
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

    def forward(self, latents, timesteps, cond, guidance, width, height):
        if cond.image_latents is None:
            return super().forward(latents, timesteps, cond, guidance, width, height)
        # The reference has the output's size (the server fits it), so its ids are the
        # generated tokens' on the next frame; the answer is the generated tokens' part.
        ids = self._latent_ids(width, height)
        reference_ids = ids.clone()
        reference_ids[..., 0] = 1
        transformer = self.pipe.transformer
        out = transformer(
            hidden_states=self.torch.cat([latents, cond.image_latents], dim=1),
            timestep=timesteps.to(latents.dtype) / 1000,
            guidance=guidance if transformer.config.guidance_embeds else None,
            encoder_hidden_states=cond.prompt_embeds, pooled_projections=cond.pooled_projections,
            txt_ids=cond.text_ids, img_ids=self.torch.cat([ids, reference_ids]),
            return_dict=False)[0]
        return out[:, :latents.shape[1]]

    def request_kwargs(self, task, width, height, references=None):
        kwargs = super().request_kwargs(task, width, height, references)
        kwargs["max_area"] = width * height
        if references:
            kwargs["_auto_resize"] = False
        return kwargs


FAMILIES = (FluxKontext,)
