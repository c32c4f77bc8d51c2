"""Facts about a diffusers pipeline that several rooms need, each said once: which of its
components are denoisers, its torch modules, and its model index (the pipeline class and the
components a model directory declares, read before anything loads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The components that denoise (Wan 2.2's second expert is transformer_2). Offloading's "dit",
# quantization, weight updates, parallelism and the memory budget all mean these.
DENOISERS = ("unet", "transformer", "transformer_2")


def is_denoiser(name: str) -> bool:
    return name in DENOISERS


def torch_modules(pipe) -> dict[str, Any]:
    """The pipeline's torch modules by component name (denoisers, text encoders, VAE, image
    encoders; tokenizers and schedulers are not modules)."""
    import torch

    return {name: m for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def denoisers(pipe) -> dict[str, Any]:
    """The pipeline's denoisers by component name, in :data:`DENOISERS` order."""
    modules = torch_modules(pipe)
    return {name: modules[name] for name in DENOISERS if name in modules}


def model_index(path: str) -> dict[str, Any] | None:
    """A model directory's ``model_index.json``; None where it cannot be read here (a hub id)."""
    try:
        return json.loads((Path(path) / "model_index.json").read_text())
    except (OSError, ValueError):
        return None


def pipeline_class_of(path: str) -> str | None:
    """The pipeline class a model directory declares, read before the model loads."""
    index = model_index(path)
    return index.get("_class_name") if index else None


def declared_components(path: str) -> dict[str, str] | None:
    """Component name -> its class name, for each component the index declares (an optional one
    left out as ``[null, null]`` is absent); None where the index cannot be read."""
    index = model_index(path)
    if index is None:
        return None
    return {name: entry[1] for name, entry in index.items()
            if isinstance(entry, list) and len(entry) == 2 and entry[1] is not None}
