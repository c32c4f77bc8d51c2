"""Stable Diffusion 1.x/2.x: a UNet over 4-channel latents, one CLIP text encoder."""

TITLE = "Stable Diffusion 1.x/2.x"
