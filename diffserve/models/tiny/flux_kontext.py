"""FLUX.1 Kontext (Flux with reference-image tokens, guidance embedding): tiny-flux-kontext."""

from __future__ import annotations

from pathlib import Path

from diffserve.models.tiny.common import save, seeded
from diffserve.models.tiny.components import clip_text_encoder, clip_tokenizer, t5_encoder, vae
from diffserve.models.tokenizers import character_t5_tokenizer


def build(directory: Path) -> None:
    """FluxKontextPipeline: a one-block MM-DiT with a guidance embedding (as Kontext [dev]),
    CLIP + T5 text encoders, 64x64 native; edits put the input image's tokens beside the
    generated ones."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel

    t5_tokenizer = character_t5_tokenizer()
    transformer = seeded(
        0, FluxTransformer2DModel, patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    pipe = FluxKontextPipeline(
        # FLUX.1's schedule: shifted by the image's token count.
        scheduler=FlowMatchEulerDiscreteScheduler(
            base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
            shift=3.0, use_dynamic_shifting=True),
        transformer=transformer,
        vae=vae(use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
                scaling_factor=1.5035),
        text_encoder=clip_text_encoder(), tokenizer=clip_tokenizer(directory),
        text_encoder_2=t5_encoder(len(t5_tokenizer)), tokenizer_2=t5_tokenizer)
    save(pipe, directory, spatial_stride=16, guidance_scale=2.5,
         pipeline_kwargs={"max_sequence_length": 64})
