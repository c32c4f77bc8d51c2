"""Stable Diffusion 3 (MM-DiT, flow matching, two CLIPs + T5): tiny-sd3."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.components import clip_text_encoder, clip_tokenizer, t5_encoder, vae
from diffserve.builders.tokenizers import character_t5_tokenizer


def build(directory: Path, latent_channels: int = 16) -> None:
    """StableDiffusion3Pipeline: a two-block MM-DiT with flow matching, two CLIP encoders and a
    T5 encoder, 16-channel latents (``latent_channels``: SD3's architecture with others, which
    diffusers' SD3 inpainting refuses), 64x64 native."""
    from diffusers import (FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)

    # SD3 joins the two CLIPs' hidden states channel-wise (32 + 64 here), pads them to the T5
    # width and puts the T5 tokens after them: the transformer's text input is T5-wide. Its
    # pooled input is both CLIPs' projections side by side.
    clip_l, clip_g, t5_dim = 32, 64, 128
    t5_tokenizer = character_t5_tokenizer()
    transformer = seeded(
        0, SD3Transformer2DModel, sample_size=8, patch_size=2, in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=2, attention_head_dim=16, num_attention_heads=2, caption_projection_dim=32,
        joint_attention_dim=t5_dim, pooled_projection_dim=clip_l + clip_g)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae(latent_channels=latent_channels, use_quant_conv=False, use_post_quant_conv=False,
                shift_factor=0.0609, scaling_factor=1.5305),
        text_encoder=clip_text_encoder(clip_l, with_projection=True),
        tokenizer=clip_tokenizer(directory),
        text_encoder_2=clip_text_encoder(clip_g, with_projection=True),
        tokenizer_2=clip_tokenizer(directory),
        text_encoder_3=t5_encoder(len(t5_tokenizer), t5_dim), tokenizer_3=t5_tokenizer)
    # SD3 pads T5 prompts to 256 tokens by default, far more text than image tokens here.
    save(pipe, directory, spatial_stride=16, guidance_scale=5.0,
         pipeline_kwargs={"max_sequence_length": 32})


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-sd3": ("Stable Diffusion 3 (MM-DiT, flow matching, two CLIPs + T5) with random weights, "
                 "64x64, 4 steps", build),
}
