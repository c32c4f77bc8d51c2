"""SDXL: Stable Diffusion XL, a UNet with added text and size conditioning, two CLIP encoders."""

TITLE = "SDXL"
