"""Flux: an MM-DiT over packed flow-matching latents, CLIP and T5, guidance as an embedding
(no classifier-free guidance pass)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from diffserve.wire.costs import NEVER
from diffserve.executor.families.blocks import JOINT
from diffserve.executor.families.conditioning import Conditioning, Encoded, shared
from diffserve.executor.families.flux import controls, rows
from diffserve.executor.families.packed_flow import PackedFlow
from diffserve.executor.families.row_sizes import processors_swapped
from diffserve.wire.tasks import IMAGE_TO_IMAGE, INPAINT


@dataclass
class FluxConditioning(Conditioning):
    prompt_embeds: Any
    pooled_projections: Any
    text_ids: Any = shared()  # the text tokens' position ids: the same for every prompt

    def prompt_tensors(self):
        return {"prompt_embeds": self.prompt_embeds[0],
                "pooled_prompt_embeds": self.pooled_projections[0]}


class Flux(PackedFlow):
    name = "flux"
    pipelines = ("FluxPipeline",)
    strength_pipelines = {IMAGE_TO_IMAGE.name: "FluxImg2ImgPipeline",
                          INPAINT.name: "FluxInpaintPipeline"}
    block_lists = {"FluxTransformer2DModel": ("transformer_blocks", "single_transformer_blocks")}
    # The single-stream blocks take and return the two streams apart (diffusers 0.42), as the
    # double-stream ones do.
    block_kinds = {"FluxTransformerBlock": JOINT, "FluxSingleTransformerBlock": JOINT}
    guidance_rule = NEVER  # guidance is an input of the transformer; negative prompts are not used
    mixes_sizes = True
    mixes_controls = True  # its ControlNets' attention stood in for per row too
    control_classes = controls.CLASSES
    control_config_keys = ("in_channels", "joint_attention_dim", "pooled_projection_dim")
    control_pipelines = controls.PIPELINES
    control_multi = controls.MULTI
    control_image_kwarg = controls.IMAGE_KWARG

    def encode(self, prompts, negatives, cfg):
        positive, pooled, text_ids = self.pipe.encode_prompt(
            prompts, None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.call_kwargs.get("max_sequence_length", 512))
        return Encoded(FluxConditioning(positive, pooled, text_ids))

    def _latent_ids(self, width: int, height: int):
        pipe = self.pipe
        lat_h = 2 * (height // (pipe.vae_scale_factor * 2))
        lat_w = 2 * (width // (pipe.vae_scale_factor * 2))
        return self._position_ids(width, height, lambda: pipe._prepare_latent_image_ids(
            1, lat_h // 2, lat_w // 2, self.device, self.dtype))

    def forward(self, latents, timesteps, cond, guidance, width, height, control=None,
                sizes=None):
        transformer = self.pipe.transformer
        residuals = {} if control is None else {
            "controlnet_block_samples": control[0] or None,
            "controlnet_single_block_samples": control[1] or None}
        mixed = sizes is not None  # rows of several sizes, padded
        with self._rows_attention(sizes, cond) if mixed else nullcontext():
            return transformer(
                hidden_states=latents, timestep=timesteps.to(latents.dtype) / 1000,
                guidance=guidance if transformer.config.guidance_embeds else None,
                encoder_hidden_states=cond.prompt_embeds,
                pooled_projections=cond.pooled_projections, txt_ids=cond.text_ids,
                img_ids=self._latent_ids(*self._longest(sizes) if mixed else (width, height)),
                **residuals, return_dict=False)[0]

    # -- rows of different sizes in one forward (diffserve.executor.families.row_sizes)

    def row_processors(self):
        return rows.kinds()

    def _rows_attention(self, sizes, cond, image_ids=None, kind: str = "", model=None):
        """``image_ids(width, height)``: a row's image-part ids (default: its image tokens');
        ``kind`` names them in the kept positions' key; ``model``: whose processors (default:
        the transformer's; a control model's share its positions)."""
        transformer, image_ids = self.pipe.transformer, image_ids or self._latent_ids
        positions = self._kept(("rows", kind, sizes.sizes, sizes.length), lambda: rows.flux_rows(
            self.torch, transformer, sizes, cond.text_ids,
            {size: image_ids(*size) for size in sizes.distinct()}))
        return processors_swapped(model or transformer, rows.kinds(),
                                  lambda inner: rows.RowsProcessor(inner, positions))

    # -- ControlNet: InstantX's kind, the control image through the VAE as packed latents, one
    # residual per double and per single block.

    def control_fits(self, module):
        why = super().control_fits(module)
        if why is None and module.input_hint_block is not None:
            return ("takes its control image as pixels (XLabs' kind); the kind served takes it "
                    "through the VAE (InstantX's)")
        return why

    def control_depth(self, module):
        return (module.config.num_layers, module.config.num_single_layers)

    def control_condition(self, module, image, width, height, k, dtype, generators):
        pipe, vae = self.pipe, self.pipe.vae
        latents = self.sampled_latents(pipe.image_processor, image, width, height, k, generators)
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        return pipe._pack_latents(latents, k, latents.shape[1], *latents.shape[2:])

    def control_call(self, module, latents, timesteps, cond, guidance, control_cond, modes,
                     width, height, sizes=None):
        mixed = sizes is not None  # rows of several sizes: the control model's attention per row
        with self._rows_attention(sizes, cond, model=module) if mixed else nullcontext():
            blocks, singles = module(
                hidden_states=latents, controlnet_cond=control_cond, controlnet_mode=modes,
                conditioning_scale=1.0, timestep=timesteps.to(latents.dtype) / 1000,
                guidance=guidance if module.config.guidance_embeds else None,
                pooled_projections=cond.pooled_projections,
                encoder_hidden_states=cond.prompt_embeds, txt_ids=cond.text_ids,
                img_ids=self._latent_ids(*self._longest(sizes) if mixed else (width, height)),
                return_dict=False)
        return list(blocks or ()), list(singles or ())

    def vae_latents(self, latents, task):
        config = self.pipe.vae.config
        return latents / config.scaling_factor + config.shift_factor


FAMILIES = (Flux,)
