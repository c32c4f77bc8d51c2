"""Qwen-Image: an MM-DiT over packed flow-matching latents conditioned on a Qwen2.5-VL text
encoder, whose prompts keep their own token lengths (padded within a forward and masked).

Guidance is the pipeline's ``true_cfg_scale``: real classifier-free guidance, run only with a
negative prompt and a scale above 1, with the pipeline's rescale of the guided prediction to the
norm of the conditional one. (The pipeline's own ``guidance_scale`` feeds guidance-distilled
variants only.)
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from diffserve.wire.costs import WITH_NEGATIVE
from diffserve.executor.families.blocks import JOINT
from diffserve.executor.families.conditioning import Conditioning, Encoded, padded
from diffserve.executor.families.packed_flow import PackedFlow
from diffserve.executor.families.qwen_image import controls, rows
from diffserve.executor.families.row_sizes import processors_swapped
from diffserve.wire.tasks import IMAGE_TO_IMAGE, INPAINT


@dataclass
class QwenImageConditioning(Conditioning):
    prompt_embeds: Any = padded()
    prompt_embeds_mask: Any = padded()  # 1 for the prompt's own tokens, 0 for padding

    def prompt_tensors(self):
        # Padded to the longest prompt it was encoded with: its own tokens only.
        return {"prompt_embeds": self.prompt_embeds[0, :int(self.prompt_embeds_mask[0].sum())]}


class QwenImage(PackedFlow):
    name = "qwen-image"
    pipelines = ("QwenImagePipeline",)
    strength_pipelines = {IMAGE_TO_IMAGE.name: "QwenImageImg2ImgPipeline",
                          INPAINT.name: "QwenImageInpaintPipeline"}
    block_lists = {"QwenImageTransformer2DModel": ("transformer_blocks",)}
    block_kinds = {"QwenImageTransformerBlock": JOINT}
    guidance_kwarg = "true_cfg_scale"
    guidance_rule = WITH_NEGATIVE
    mixes_sizes = True
    mixes_controls = True  # its ControlNets' attention stood in for per row too
    text_bucket = 64  # a 64-token pad is under 2% of a 1024x1024 image's 4,096 tokens
    control_classes = controls.CLASSES
    control_config_keys = ("in_channels", "joint_attention_dim")
    control_pipelines = controls.PIPELINES  # generation only (qwen_image/controls.py)
    control_multi = controls.MULTI
    control_image_kwarg = controls.IMAGE_KWARG
    control_from_positive = True  # its pipeline runs one control pass a step, on the prompt

    def _encode(self, prompts: list[str]) -> QwenImageConditioning:
        embeds, mask = self.pipe.encode_prompt(
            prompts, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.call_kwargs.get("max_sequence_length", 512))
        if mask is None:  # every prompt as long as the longest: all of each is real
            mask = self.torch.ones(embeds.shape[:2], dtype=self.torch.long, device=embeds.device)
        return QwenImageConditioning(embeds, mask)

    def encode(self, prompts, negatives, cfg):
        return Encoded(self._encode(prompts), self._encode(negatives) if cfg else None)

    def forward(self, latents, timesteps, cond, guidance, width, height, control=None,
                sizes=None):
        if sizes is not None:  # rows of several sizes, padded
            with self._rows_attention(sizes, cond):
                return self.transform(latents, timesteps, cond,
                                      [self.grid(*self._longest(sizes))],
                                      control[0] if control is not None else None)
        return self.transform(latents, timesteps, cond, [self.grid(width, height)],
                              control[0] if control is not None else None)

    # -- rows of different sizes in one forward (diffserve.executor.families.row_sizes)

    def row_processors(self):
        return rows.kinds()

    def _rows_attention(self, sizes, cond, grids=None, kind: str = "", model=None):
        """``grids(width, height)``: a row's image-part grids (default: its image's alone);
        ``kind`` names them in the kept positions' key; ``model``: whose processors (default:
        the transformer's; a control model's share its positions)."""
        transformer, length = self.pipe.transformer, cond.prompt_embeds.shape[1]
        grids = grids or self.grid
        key = ("rows", kind, sizes.sizes, sizes.length, length)
        positions = self._kept(key, lambda: rows.qwen_rows(
            self.torch, transformer, sizes, {size: grids(*size) for size in sizes.distinct()},
            length, cond.prompt_embeds.device))
        return processors_swapped(model or transformer, rows.kinds(),
                                  lambda inner: rows.RowsProcessor(inner, positions))

    _mask_seen: tuple = (None, None)  # the last forward's mask, and what mask_of made of it

    def mask_of(self, cond):
        """The forward's text mask, or None where every row's prompt fills it, as the pipeline
        drops an all-true mask: attention without a mask may run on the flash kernels. A set's
        conditioning is the same object from step to step while its rows stay, so the device is
        asked (a synchronisation) once per change of rows, not at every step."""
        mask = cond.prompt_embeds_mask
        if mask is not self._mask_seen[0]:
            self._mask_seen = (mask, None if mask is None or bool(mask.all()) else mask)
        return self._mask_seen[1]

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """An image's token grid as the transformer's position ids take it (one frame)."""
        scale = self.pipe.vae_scale_factor
        return (1, height // scale // 2, width // scale // 2)

    def transform(self, latents, timesteps, cond, grids, control=None):
        """The transformer over ``latents`` whose tokens are the images of ``grids`` in turn;
        ``control``: a ControlNet's residual for each block (or None)."""
        return self.pipe.transformer(
            hidden_states=latents, timestep=timesteps.to(latents.dtype) / 1000, guidance=None,
            encoder_hidden_states_mask=self.mask_of(cond),
            encoder_hidden_states=cond.prompt_embeds, img_shapes=[grids] * latents.shape[0],
            **({"controlnet_block_samples": control} if control else {}), return_dict=False)[0]

    # -- ControlNet: the control image through the VAE as packed latents, one residual per block,
    # computed from the prompt's rows and added to both rows of true CFG, as the pipeline does.

    def control_depth(self, module):
        return (module.config.num_layers,)

    def control_condition(self, module, image, width, height, k, dtype, generators):
        torch, pipe, vae = self.torch, self.pipe, self.pipe.vae
        latents = self.sampled_latents(pipe.image_processor, image, width, height, k, generators)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device)
        latents = ((latents - mean) * std).permute(0, 2, 1, 3, 4)
        return pipe._pack_latents(latents, latents.shape[0], pipe.transformer.config.in_channels // 4,
                                  latents.shape[3], latents.shape[4]).to(self.device, dtype)

    def control_call(self, module, latents, timesteps, cond, guidance, control_cond, modes,
                     width, height, sizes=None):
        mixed = sizes is not None  # rows of several sizes: the control model's attention per row
        with self._rows_attention(sizes, cond, model=module) if mixed else nullcontext():
            samples = module(
                hidden_states=latents, controlnet_cond=control_cond, conditioning_scale=1.0,
                timestep=timesteps.to(latents.dtype) / 1000,
                encoder_hidden_states=cond.prompt_embeds,
                encoder_hidden_states_mask=self.mask_of(cond),
                img_shapes=[[self.grid(*self._longest(sizes) if mixed else (width, height))]]
                * latents.shape[0], return_dict=False)
        return (list(samples),)

    def guide(self, uncond, cond, scale):
        guided = uncond + scale * (cond - uncond)
        # The pipeline keeps the conditional prediction's norm, per token.
        return guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))

    def vae_latents(self, latents, task):
        config, torch = self.pipe.vae.config, self.torch
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
        return latents * std + mean

    def image_latents_of(self, latents, width, height):
        return self.unpack(latents, width, height)[:, :, 0]  # the VAE's latents carry a frame axis

    def vae_decode(self, latents):
        return self.pipe.vae.decode(latents, return_dict=False)[0][:, :, 0]


FAMILIES = (QwenImage,)
