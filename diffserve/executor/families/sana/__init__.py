"""Sana: a linear-attention DiT, a deep-compression VAE, Gemma 2."""

TITLE = "Sana"
