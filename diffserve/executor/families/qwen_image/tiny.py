"""Qwen-Image (MM-DiT, flow matching, Qwen2.5-VL text encoder): tiny-qwen-image."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.components import qwen2_5_vl_encoder
from diffserve.builders.tokenizers import qwen2_tokenizer


def build(directory: Path) -> None:
    """QwenImagePipeline: a two-block MM-DiT with flow matching over 2x2-packed latents of a 3D
    (video-style) VAE, conditioned on a Qwen2.5-VL's last hidden states, 64x64 native."""
    from diffusers import QwenImagePipeline

    # The pipeline wraps each prompt in a chat template (set in its __init__, hence read from a
    # pipeline with no components) and drops the template's first 34 tokens: with Qwen's
    # vocabulary, all that precedes the prompt. Learning the template's words keeps it so.
    template = QwenImagePipeline(None, None, None, None, None).prompt_template_encode
    tokenizer = qwen2_tokenizer([template])
    hidden = 32
    transformer, vae = denoiser_and_vae(hidden)
    pipe = QwenImagePipeline(
        scheduler=scheduler(), vae=vae, text_encoder=qwen2_5_vl_encoder(tokenizer, hidden),
        tokenizer=tokenizer, transformer=transformer)
    # guidance_scale is true_cfg_scale's default: the pipeline's own guidance_scale only feeds
    # guidance-distilled transformers, which this one is not.
    save(pipe, directory, spatial_stride=16, guidance_scale=4.0)


def denoiser_and_vae(hidden: int):
    """Qwen-Image's two-block MM-DiT (text width ``hidden``) and its 3D VAE, tiny; the edit
    models share them."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    # Packed latents have 4x the VAE's 16 channels in, and the transformer gives 16 back per
    # 2x2 patch. The RoPE axes (frame, height, width) add up to the head width.
    transformer = seeded(
        0, QwenImageTransformer2DModel, patch_size=2, in_channels=64, out_channels=16,
        num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=hidden,
        axes_dims_rope=(4, 6, 6))
    # Three spatial downsamplings (8x), two of them also in time, as in the real VAE, whose
    # per-channel latent mean and std are the class defaults.
    vae = seeded(0, AutoencoderKLQwenImage, base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4],
                 num_res_blocks=1, temperal_downsample=[False, True, True])
    return transformer, vae


def scheduler():
    """Qwen-Image's own scheduler settings: the shift grows with the image token count."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
        shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential")


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-qwen-image": ("Qwen-Image (MM-DiT, flow matching, Qwen2.5-VL text encoder) with "
                        "random weights, 64x64, 4 steps", build),
}
