"""Where a ``--model`` value points to, and the serving defaults kept beside a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diffserve.builders import random as random_weights
from diffserve.builders.embedded import (
    EMBEDDED,
    EMBEDDED_CONTROLNETS,
    PACKAGED,
    SERVING_DEFAULTS_FILE,
    cache_root,
    embedded_path,
)


def resolve_model(spec: str) -> str:
    """A packaged or embedded model name, a released architecture with random weights
    (``random:NAME[:tiny]``, :mod:`diffserve.builders.random`), a local pipeline directory, or
    (left to diffusers) a hub id."""
    if random_weights.is_random(spec):
        return random_weights.resolve(spec, cache_root())
    if spec in PACKAGED:
        return str(PACKAGED[spec][1])
    if spec in EMBEDDED:
        return str(embedded_path(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if path.exists():
        raise ValueError(f"--model {spec!r} is a file; expected a diffusers pipeline directory")
    if spec.startswith((".", "/", "~")):
        raise ValueError(f"--model {spec!r}: no such directory")
    return spec


def resolve_controlnet(spec: str) -> str:
    """An embedded ControlNet's name, a local ControlNet directory, or (left to diffusers) a hub
    id."""
    if spec in EMBEDDED_CONTROLNETS:
        return str(embedded_path(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if path.exists() or spec.startswith((".", "/", "~")):
        raise ValueError(f"--controlnet {spec!r}: no such ControlNet directory")
    return spec


def serving_defaults(model_dir: str) -> dict[str, Any]:
    """Optional ``diffserve.json`` beside the weights: width, height, spatial_stride,
    num_inference_steps, guidance_scale and extra ``pipeline_kwargs`` for every call."""
    path = Path(model_dir) / SERVING_DEFAULTS_FILE
    if not path.is_file():
        return {}
    return json.loads(path.read_text())
