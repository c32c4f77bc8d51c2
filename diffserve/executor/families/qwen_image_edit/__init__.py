"""Qwen-Image-Edit: Qwen-Image edited by instruction (Edit and Edit-Plus)."""

TITLE = "Qwen-Image-Edit"
