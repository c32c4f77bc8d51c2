"""Wan: Wan 2.1/2.2 video: a 3D DiT, a video VAE, UMT5 (text- and image-to-video)."""

TITLE = "Wan"
