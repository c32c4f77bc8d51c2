"""FLUX.1 Fill: Flux whose denoiser also takes the masked image and the mask: inpainting and
outpainting."""

TITLE = "FLUX.1 Fill"
