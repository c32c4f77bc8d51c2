"""HunyuanVideo 1.5: a 3D DiT over a video VAE's latents, Qwen2.5-VL text plus ByT5 for quoted
glyph text, flow matching, guidance by the pipeline's guider (text-to-video)."""

TITLE = "HunyuanVideo 1.5"
