"""FLUX.1 Fill (Flux whose transformer also takes the masked image and the mask): tiny-flux-fill."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.executor.families.flux.tiny import components, dev_schedule


def build(directory: Path) -> None:
    """FluxFillPipeline: a one-block MM-DiT with a guidance embedding (as Fill [dev]) whose input
    is the latents' tokens, the masked image's and the mask's (64 values a token side: the VAE's
    8x8 pixels per latent cell), CLIP + T5 text encoders, 64x64 native."""
    from diffusers import FluxFillPipeline, FluxTransformer2DModel

    parts = components(directory, guidance_embeds=True)
    latent = parts["vae"].config.latent_channels * 4  # a token: 2x2 latent cells
    scale = 2 ** (len(parts["vae"].config.block_out_channels) - 1)
    parts["transformer"] = seeded(
        0, FluxTransformer2DModel, patch_size=1, in_channels=2 * latent + scale * scale * 4,
        out_channels=latent, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    pipe = FluxFillPipeline(
        scheduler=dev_schedule(),
        **parts)
    save(pipe, directory, spatial_stride=16, guidance_scale=30.0,
         pipeline_kwargs={"max_sequence_length": 64})


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-flux-fill": ("FLUX.1 Fill (Flux conditioned on the masked image and the mask: "
                       "inpainting and outpainting) with random weights, 64x64, 4 steps", build),
}
