"""Z-Image: a single-stream DiT, flow matching, Qwen3."""

TITLE = "Z-Image"
