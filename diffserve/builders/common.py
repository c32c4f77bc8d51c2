"""The steps every tiny-model build shares: seeded construction of each module, and saving the
pipeline as an ordinary diffusers directory next to its serving defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SERVING_DEFAULTS_FILE = "diffserve.json"
# Tokenizers that can only be loaded from files are written under the build directory here;
# ``save`` removes it, so it never reaches the saved pipeline.
SCRATCH = "_tok"


def seeded(seed: int, build, /, *args, **kwargs):
    """``build(*args, **kwargs)`` right after ``torch.manual_seed(seed)``: each module's random
    weights then depend on its own seed alone, not on what was built before it."""
    import torch

    torch.manual_seed(seed)
    return build(*args, **kwargs)


def save(pipe, directory: Path, *, spatial_stride: int, guidance_scale: float, size: int = 64,
         num_inference_steps: int = 4, pipeline_kwargs: dict | None = None, **more) -> None:
    """Save ``pipe`` in ``directory`` (``save_pretrained`` layout) with its serving defaults: a
    ``size`` x ``size`` native image, ``spatial_stride`` pixels per latent token, and the steps,
    guidance and extra pipeline arguments a request gets unless it says otherwise; ``more``:
    further defaults (a video model's ``num_frames`` and ``fps``)."""
    shutil.rmtree(directory / SCRATCH, ignore_errors=True)
    pipe.save_pretrained(directory)
    defaults = dict(width=size, height=size, spatial_stride=spatial_stride,
                    num_inference_steps=num_inference_steps, guidance_scale=guidance_scale)
    if pipeline_kwargs:
        defaults["pipeline_kwargs"] = pipeline_kwargs
    defaults.update(more)
    (directory / SERVING_DEFAULTS_FILE).write_text(json.dumps(defaults, indent=2) + "\n")
