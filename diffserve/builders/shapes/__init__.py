"""``shapes``: a tiny text-to-image model trained from scratch on CPU.

It draws one flat circle, square or triangle of one of eight colours on a plain background of
another, at 32x32 pixels, from prompts such as ``"a red circle on a blue background"``. It is an
ordinary diffusers StableDiffusionPipeline (autoencoder, UNet, CLIP text encoder, byte-level
tokenizer) kept in :data:`WEIGHTS_DIR`. It is trained, reproducibly, by ``tools/shapes`` in the
repository (not part of the installed package); see ``docs/shapes.md``.
"""

from __future__ import annotations

from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"

__all__ = ["WEIGHTS_DIR"]
