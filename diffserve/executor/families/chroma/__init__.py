"""Chroma: a Flux-style MM-DiT with classifier-free guidance, T5."""

TITLE = "Chroma"
