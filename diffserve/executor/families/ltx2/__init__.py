"""LTX-2: video with its sound track: one DiT over video and audio latents, Gemma 3 text through
connectors, a video VAE, an audio VAE and a vocoder (text- and image-to-video)."""

TITLE = "LTX-2"
