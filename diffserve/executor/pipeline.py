"""Facts about a diffusers pipeline that several rooms need, each said once: which of its
components are denoisers, its torch modules, its model index (the pipeline class and the
components a model directory declares, read before anything loads), and another pipeline built
over its components."""

from __future__ import annotations

import json
from contextlib import contextmanager
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


def built_from(pipe, class_name: str, **components) -> Any:
    """Diffusers pipeline ``class_name`` over ``pipe``'s own components (``components`` added or
    replacing some), each module as it is: no copy, no cast. ``from_pipe`` would cast every
    module it shares to one dtype (float32 unless told), the loaded pipeline's own included,
    which undoes bfloat16 and a float32 VAE or host text encoder alike. Raises TypeError where a
    component the class needs is missing."""
    import diffusers

    cls = getattr(diffusers, class_name)
    modules, options = cls._get_signature_keys(cls)
    given = {**pipe.components, **components}
    kwargs = {name: given[name] for name in modules if name in given}
    kwargs.update({name: value for name, value in pipe.config.items()
                   if name in options and name not in kwargs})  # e.g. requires_safety_checker
    return cls(**kwargs)


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


@contextmanager
def guidance_on_guider(pipe, scale: float):
    """For the duration of a call, ``scale`` as the guidance scale of a pipeline whose guider
    holds it rather than its call (HunyuanVideo 1.5); nothing for the others."""
    guider = getattr(pipe, "guider", None)
    if guider is None or not hasattr(guider, "guidance_scale"):
        yield
        return
    kept, guider.guidance_scale = guider.guidance_scale, scale
    try:
        yield
    finally:
        guider.guidance_scale = kept


@contextmanager
def size_as_asked(pipe, width: int, height: int):
    """For the duration of a call, the request's size as the size a pipeline that picks its own
    from the input image's aspect (HunyuanVideo 1.5's image-to-video: a bucket of its
    ``target_size``'s area, which cannot reach every size on the stride) makes; nothing for the
    others. The server fits the image to the size first, so the pipeline's crop is a no-op."""
    processor = getattr(pipe, "video_processor", None)
    if processor is None or not hasattr(processor, "calculate_default_height_width"):
        yield
        return
    processor.calculate_default_height_width = lambda **_: (height, width)
    try:
        yield
    finally:
        del processor.calculate_default_height_width
