"""Embedded tiny models: real diffusers pipelines built offline from small configs, one module
per family.

Their weights are random (drawn from a fixed seed), so they make noise-like images; they exist
so that the whole server runs, and is tested, on any CPU with no download. Each builder writes
an ordinary diffusers pipeline directory (``save_pretrained`` layout plus ``diffserve.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from diffserve.models.tiny import flux, hunyuandit, pixart, qwen_image, sana, sd, sd3, sdxl
from diffserve.models.tiny.common import SERVING_DEFAULTS_FILE

__all__ = ["EMBEDDED", "SERVING_DEFAULTS_FILE"]

# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED: dict[str, tuple[str, Callable[[Path], None]]] = {
    "tiny-sd": ("Stable Diffusion (UNet) with random weights, 64x64, 4 steps", sd.build),
    "sd-mid": ("Stable Diffusion (UNet) with random weights, about 36M parameters, 128x128, 4 steps: "
               "costly enough per step for batching to matter, for benchmarks", sd.build_mid),
    "tiny-sdxl": ("Stable Diffusion XL (UNet, two CLIP encoders) with random weights, 64x64, 4 steps",
                  sdxl.build),
    "tiny-sd3": ("Stable Diffusion 3 (MM-DiT, flow matching, two CLIPs + T5) with random weights, "
                 "64x64, 4 steps", sd3.build),
    "tiny-flux": ("Flux (MM-DiT, flow matching) with random weights, 64x64, 4 steps", flux.build),
    "tiny-hunyuandit": ("HunyuanDiT (DiT, BERT + T5) with random weights, 64x64, 4 steps; a regression "
                        "fixture: its pipeline turns a 64x64 request into 1024x1024 unless called "
                        "with use_resolution_binning=False", hunyuandit.build),
    "tiny-qwen-image": ("Qwen-Image (MM-DiT, flow matching, Qwen2.5-VL text encoder) with "
                        "random weights, 64x64, 4 steps", qwen_image.build),
    "tiny-pixart-sigma": ("PixArt-Sigma (DiT with cross-attention, T5) with random weights, "
                          "64x64, 4 steps", pixart.build),
    "tiny-sana": ("Sana (linear-attention DiT, deep-compression VAE, Gemma 2 text encoder) "
                  "with random weights, 64x64, 4 steps", sana.build),
}
