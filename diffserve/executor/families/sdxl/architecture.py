"""Stable Diffusion XL base's released architecture for ``random:sdxl`` (and ``random:sdxl:tiny``):
its modules at the published size and what the tiny scale changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffserve.builders.random.parts import FULL, Architecture, Module, clip, size


def _sdxl_others(scale: str, scratch: Path) -> dict[str, Any]:
    from diffusers import EulerDiscreteScheduler

    from diffserve.builders.tokenizers import write_byte_clip_tokenizer

    clip = write_byte_clip_tokenizer(scratch / "clip")
    return {"tokenizer": clip, "tokenizer_2": clip,
            "scheduler": EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012,
                                                beta_schedule="scaled_linear", steps_offset=1,
                                                timestep_spacing="leading")}


SDXL = Architecture(
    "StableDiffusionXLPipeline", "Stable Diffusion XL base: a 2.6B UNet, CLIP-L and "
    "OpenCLIP-bigG, its VAE",
    {"unet": Module("diffusers", "UNet2DConditionModel",
                    dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
                         block_out_channels=(320, 640, 1280),
                         down_block_types=("DownBlock2D", "CrossAttnDownBlock2D",
                                           "CrossAttnDownBlock2D"),
                         up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                         transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
                         cross_attention_dim=2048, use_linear_projection=True,
                         addition_embed_type="text_time", addition_time_embed_dim=256,
                         projection_class_embeddings_input_dim=2816),
                    dict(sample_size=8, layers_per_block=1, block_out_channels=(32, 64),
                         down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                         up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                         transformer_layers_per_block=(1, 2), attention_head_dim=8,
                         cross_attention_dim=96, addition_time_embed_dim=8,
                         projection_class_embeddings_input_dim=6 * 8 + 64, norm_num_groups=8)),
     "vae": Module("diffusers", "AutoencoderKL",
                   dict(latent_channels=4, block_out_channels=(128, 256, 512, 512),
                        layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=0.13025,
                        sample_size=1024, force_upcast=True),
                   dict(block_out_channels=(16, 16, 32, 32), layers_per_block=1,
                        norm_num_groups=8, sample_size=64, force_upcast=False)),
     "text_encoder": clip(768, 12, 12, 3072, "quick_gelu"),
     "text_encoder_2": clip(1280, 32, 20, 5120, "gelu", tiny_width=64, projection=True)},
    _sdxl_others,
    lambda scale: {**size(scale, 1024), "spatial_stride": 8, "guidance_scale": 5.0,
                   "num_inference_steps": 30 if scale == FULL else 4},
    pipeline_config={"force_zeros_for_empty_prompt": True})


ARCHITECTURES = {"sdxl": SDXL}
