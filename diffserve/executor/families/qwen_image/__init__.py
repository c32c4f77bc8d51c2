"""Qwen-Image: an MM-DiT over flow matching, a Qwen2.5-VL text encoder."""

TITLE = "Qwen-Image"
