"""Embedded tiny models: real diffusers pipelines built offline from small configs, one module
per family.

Their weights are random (drawn from a fixed seed), so they make noise-like images; they exist
so that the whole server runs, and is tested, on any CPU with no download. Each builder writes
an ordinary diffusers pipeline directory (``save_pretrained`` layout plus ``diffserve.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from diffserve.models.tiny import chroma
from diffserve.models.tiny import flux
from diffserve.models.tiny import flux2
from diffserve.models.tiny import flux_kontext
from diffserve.models.tiny import hunyuandit
from diffserve.models.tiny import pixart
from diffserve.models.tiny import qwen_image
from diffserve.models.tiny import qwen_image_edit
from diffserve.models.tiny import sana
from diffserve.models.tiny import sd
from diffserve.models.tiny import sd3
from diffserve.models.tiny import sdxl
from diffserve.models.tiny import wan
from diffserve.models.tiny import z_image
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
    "tiny-flux2": ("FLUX.2 [dev] (MM-DiT, flow matching, guidance embedding, Mistral 3 text "
                   "encoder; edits with reference images) with random weights, 64x64, 4 steps",
                   flux2.build),
    "tiny-flux2-klein": ("FLUX.2 [klein] (FLUX.2 with classifier-free guidance, Qwen3 text "
                         "encoder; edits with reference images) with random weights, 64x64, "
                         "4 steps", flux2.build_klein),
    "tiny-flux-kontext": ("FLUX.1 Kontext (Flux with reference-image tokens: instruction edits) "
                          "with random weights, 64x64, 4 steps", flux_kontext.build),
    "tiny-hunyuandit": ("HunyuanDiT (DiT, BERT + T5) with random weights, 64x64, 4 steps; a regression "
                        "fixture: its pipeline turns a 64x64 request into 1024x1024 unless called "
                        "with use_resolution_binning=False", hunyuandit.build),
    "tiny-qwen-image": ("Qwen-Image (MM-DiT, flow matching, Qwen2.5-VL text encoder) with "
                        "random weights, 64x64, 4 steps", qwen_image.build),
    "tiny-qwen-image-edit": ("Qwen-Image-Edit (Qwen-Image edited by instruction: the input image "
                             "through the VAE and the Qwen2.5-VL) with random weights, 64x64, 4 "
                             "steps", qwen_image_edit.build),
    "tiny-qwen-image-edit-plus": ("Qwen-Image-Edit-Plus (2509: one to three input images) with "
                                  "random weights, 64x64, 4 steps", qwen_image_edit.build_plus),
    "tiny-pixart-sigma": ("PixArt-Sigma (DiT with cross-attention, T5) with random weights, "
                          "64x64, 4 steps", pixart.build),
    "tiny-sana": ("Sana (linear-attention DiT, deep-compression VAE, Gemma 2 text encoder) "
                  "with random weights, 64x64, 4 steps", sana.build),
    "tiny-z-image": ("Z-Image-Turbo (single-stream DiT, flow matching, Qwen3 text encoder) with "
                     "random weights, 64x64, 4 steps", z_image.build),
    "tiny-chroma": ("Chroma (Flux-style MM-DiT, flow matching, T5, classifier-free guidance) "
                    "with random weights, 64x64, 4 steps", chroma.build),
    "tiny-wan": ("Wan 2.1 text-to-video (3D DiT, video VAE, UMT5) with random weights, 32x32, "
                 "9 frames, 4 steps", wan.build),
    "tiny-wan22": ("Wan 2.2 text-to-video (two experts switched at boundary_ratio 0.875) with "
                   "random weights, 32x32, 9 frames, 4 steps", wan.build_22),
    "tiny-wan-i2v": ("Wan 2.1 image-to-video (the first frame through CLIP vision and the VAE) "
                     "with random weights, 32x32, 9 frames, 4 steps", wan.build_i2v),
}
