"""PixArt-Sigma: a DiT with cross-attention, T5."""

TITLE = "PixArt-Sigma"
