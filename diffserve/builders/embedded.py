"""Models that need no download: the packaged trained ones, and the embedded tiny ones (each
family folder's ``tiny.py``, :func:`diffserve.executor.families.embedded_models`), each built
once and cached on disk as an ordinary diffusers pipeline directory, which is then loaded like
any other local model.
"""

from __future__ import annotations

import os
from functools import partial
import shutil
import tempfile
from pathlib import Path

from diffserve.builders.common import SERVING_DEFAULTS_FILE
from diffserve.builders.controlnets import EMBEDDED_CONTROLNETS
from diffserve.builders.shapes import WEIGHTS_DIR as SHAPES_WEIGHTS
from diffserve.executor.families import embedded_models

__all__ = ["EMBEDDED", "EMBEDDED_CONTROLNETS", "PACKAGED", "SERVING_DEFAULTS_FILE", "cache_root",
           "embedded_path"]

# Bump when a family's tiny builder changes so that stale caches are rebuilt rather
# than reused.
_BUILD_VERSION = 1
_CONTROLNET_VERSION = 3  # the tiny ControlNets' own (3: a UNet ControlNet's smaller embedding)

# name -> (description, builder(directory)): every family folder's tiny models.
EMBEDDED = embedded_models()

# Models whose trained weights ship inside the package: name -> (description, directory).
PACKAGED: dict[str, tuple[str, Path]] = {
    "shapes": ("Stable Diffusion trained on CPU to draw a coloured circle, square or triangle on a "
               "plain background, 32x32, 20 steps (see docs/shapes.md)", SHAPES_WEIGHTS),
}


def cache_root() -> Path:
    root = os.environ.get("DIFFSERVE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "diffserve"


def embedded_path(name: str) -> Path:
    """Directory of embedded model (or ControlNet) ``name``, building it first if it is not
    cached yet.

    The build goes to a temporary directory that is renamed into place, so concurrent first
    uses (several servers or test workers) never see a half-written model."""
    if name in EMBEDDED:
        build, done, version = EMBEDDED[name][1], SERVING_DEFAULTS_FILE, f"{_BUILD_VERSION}"
    elif name in EMBEDDED_CONTROLNETS:
        _, base, builder = EMBEDDED_CONTROLNETS[name]
        build, done = partial(builder, base=embedded_path(base)), "config.json"
        version = f"{_BUILD_VERSION}.{_CONTROLNET_VERSION}"
    else:
        raise KeyError(name)
    return built_in_place(cache_root() / "models" / f"{name}-v{version}", done, build)


def built_in_place(target: Path, done: str, build) -> Path:
    """``target``, made by ``build(directory)`` first where its file ``done`` is missing: built in
    a temporary directory renamed into place, so that processes starting together never read
    half of one (the first rename wins; the others' copies are dropped)."""
    if (target / done).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / done).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
