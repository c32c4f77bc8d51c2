"""Flux (MM-DiT, flow matching, CLIP + T5): tiny-flux."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.components import clip_text_encoder, clip_tokenizer, t5_encoder, vae
from diffserve.builders.tokenizers import character_t5_tokenizer


def build(directory: Path) -> None:
    """FluxPipeline: a one-block MM-DiT with flow matching, CLIP + T5 text encoders, 64x64 native."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), **components(directory))
    # Flux pads T5 prompts to 512 tokens by default; 64 is plenty here and much faster.
    save(pipe, directory, spatial_stride=16, guidance_scale=3.5,
         pipeline_kwargs={"max_sequence_length": 64})


def dev_schedule():
    """FLUX.1 [dev]'s schedule (Kontext's and Fill's too): shifted by the image's token count."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5,
                                           max_image_seq_len=4096, max_shift=1.15, shift=3.0,
                                           use_dynamic_shifting=True)


def components(directory: Path, guidance_embeds: bool = False) -> dict:
    """A one-block MM-DiT (with a guidance embedding where ``guidance_embeds``, as FLUX.1 [dev]
    and Kontext), Flux's VAE, CLIP and T5 with their tokenizers: all but the scheduler."""
    from diffusers import FluxTransformer2DModel

    t5_tokenizer = character_t5_tokenizer()
    transformer = seeded(
        0, FluxTransformer2DModel, patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6))
    return dict(
        transformer=transformer,
        vae=vae(use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
                scaling_factor=1.5035),
        text_encoder=clip_text_encoder(), tokenizer=clip_tokenizer(directory),
        text_encoder_2=t5_encoder(len(t5_tokenizer)), tokenizer_2=t5_tokenizer)


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-flux": ("Flux (MM-DiT, flow matching) with random weights, 64x64, 4 steps", build),
}
