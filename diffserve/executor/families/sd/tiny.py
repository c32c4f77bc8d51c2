"""Stable Diffusion (UNet) at two sizes: tiny-sd and sd-mid."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.components import clip_text_encoder, clip_tokenizer, vae


@dataclass(frozen=True)
class SDSize:
    """The knobs that set a Stable Diffusion build's size, and so its cost per step."""

    image_size: int                  # native width and height in pixels (latents are 1/8 of it)
    unet_channels: tuple[int, ...]   # one UNet level each; all but the deepest have cross-attention
    unet_norm_groups: int
    text_hidden: int                 # CLIP width, which is also the UNet's cross-attention width
    text_layers: int
    text_intermediate: int
    vae_channels: tuple[int, ...]
    vae_norm_groups: int
    seeds: tuple[int, int, int] = (0, 0, 0)  # weight seeds of the UNet, VAE and text encoder


# tiny-sd: about 1.1M parameters in all, so cheap that per-request overheads dominate.
SD_TINY = SDSize(image_size=64, unet_channels=(32, 64), unet_norm_groups=8, text_hidden=32,
                 text_layers=2, text_intermediate=64, vae_channels=(16, 16, 32, 32), vae_norm_groups=8)
# sd-mid: about 36M parameters (UNet about 29M) at 128x128, costly enough per step for batching
# to matter the way it does with real models. Its seeds keep it byte-identical to the mid-size
# model the earlier benchmark figures were taken on.
SD_MID = SDSize(image_size=128, unet_channels=(96, 192, 384), unet_norm_groups=32, text_hidden=256,
                text_layers=4, text_intermediate=1024, vae_channels=(32, 64, 128, 128),
                vae_norm_groups=32, seeds=(0, 1, 2))


def build(directory: Path, size: SDSize = SD_TINY) -> None:
    """StableDiffusionPipeline: a UNet with cross-attention, its size from ``size``."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    levels = len(size.unet_channels)
    unet_seed, vae_seed, text_seed = size.seeds
    unet = seeded(
        unet_seed, UNet2DConditionModel, sample_size=size.image_size // 8, in_channels=4,
        out_channels=4, layers_per_block=1, block_out_channels=size.unet_channels,
        down_block_types=("CrossAttnDownBlock2D",) * (levels - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (levels - 1),
        cross_attention_dim=size.text_hidden, attention_head_dim=8,
        norm_num_groups=size.unet_norm_groups)
    pipe = StableDiffusionPipeline(
        vae=vae(channels=size.vae_channels, norm_groups=size.vae_norm_groups,
                sample_size=size.image_size, seed=vae_seed),
        text_encoder=clip_text_encoder(size.text_hidden, layers=size.text_layers,
                                       intermediate=size.text_intermediate, seed=text_seed),
        tokenizer=clip_tokenizer(directory), unet=unet,
        scheduler=DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                clip_sample=False, set_alpha_to_one=False, steps_offset=1),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    save(pipe, directory, size=size.image_size, spatial_stride=8, guidance_scale=5.0)


build_mid = partial(build, size=SD_MID)


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-sd": ("Stable Diffusion (UNet) with random weights, 64x64, 4 steps", build),
    "sd-mid": ("Stable Diffusion (UNet) with random weights, about 36M parameters, 128x128, 4 steps: "
               "costly enough per step for batching to matter, for benchmarks", build_mid),
}
