"""Flux: FLUX.1: an MM-DiT over packed flow-matching latents, CLIP and T5."""

TITLE = "Flux"
