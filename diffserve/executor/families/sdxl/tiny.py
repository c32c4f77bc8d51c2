"""Stable Diffusion XL (UNet, two CLIP encoders): tiny-sdxl."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.components import clip_text_encoder, clip_tokenizer, vae


def build(directory: Path) -> None:
    """StableDiffusionXLPipeline: a two-level UNet conditioned on two CLIP encoders (their
    penultimate hidden states side by side, and the second one's pooled projection together
    with the size and crop ids), 64x64 native."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    # Two encoder widths that differ, as in SDXL (768 and 1280), so a mix-up cannot pass unseen.
    hidden, hidden_2, time_dim = 32, 64, 8
    unet = seeded(
        0, UNet2DConditionModel, sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2),
        cross_attention_dim=hidden + hidden_2, attention_head_dim=8, use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=time_dim,
        # Six micro-conditioning ids (original size, crop corner, target size), each embedded in
        # time_dim channels, next to the second encoder's pooled projection.
        projection_class_embeddings_input_dim=6 * time_dim + hidden_2, norm_num_groups=8)
    pipe = StableDiffusionXLPipeline(
        vae=vae(scaling_factor=0.13025, force_upcast=False),
        text_encoder=clip_text_encoder(hidden),
        text_encoder_2=clip_text_encoder(hidden_2, with_projection=True),
        tokenizer=clip_tokenizer(directory), tokenizer_2=clip_tokenizer(directory), unet=unet,
        # SDXL's own scheduler and its settings.
        scheduler=EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012,
                                         beta_schedule="scaled_linear", steps_offset=1,
                                         timestep_spacing="leading"),
        add_watermarker=False)
    save(pipe, directory, spatial_stride=8, guidance_scale=5.0)


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-sdxl": ("Stable Diffusion XL (UNet, two CLIP encoders) with random weights, 64x64, 4 steps",
                  build),
}
