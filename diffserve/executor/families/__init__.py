"""The pipeline families, one folder each, and the tables derived from their folders.

A family's folder holds all that is its own: ``step`` (its step adapter, a
:class:`~diffserve.executor.families.base.Family` subclass per pipeline, listed in the module's
``FAMILIES``), ``tiny`` (its tiny random-weight test models, ``EMBEDDED``), ``architecture`` (its
released architecture for ``random:NAME``, ``ARCHITECTURES``) and ``controls`` (its ControlNet
pipelines, for families that take control models). A folder has the parts it needs: HunyuanDiT
runs in request mode only, so its folder holds its tiny model alone. The folder's ``__init__``
names the family (``TITLE``) and nothing else, so that reading a table imports no torch and no
step adapter: the frontend and the scheduler read the tables too.

What every family's step adapter shares lives beside the folders: ``base`` (a request's
schedule, its first latents for each task, the inpainting blend, decoding), ``conditioning``
(the rows a forward combines), ``packed_flow`` (packed flow-matching latents), ``blocks`` (the
denoisers' block declarations), ``control_hooks`` (what a family does for ControlNet),
``reference_batch`` (instruction edits' references), ``schedulers`` (a request's scheduler
inside its pipeline's helpers) and ``outputs`` (pixels as answered); ``known`` is the step
engine's lookup of a family by pipeline class. May import ``model``, ``memory`` and the house's
low modules.

Adding a family is its folder plus its line in :data:`FOLDERS`.

In the package's layers (``diffserve.LAYERS``) a folder's :data:`BUILDER_PARTS`, the folder's
``__init__`` and this registry sit with ``diffserve.builders``: they build and describe models and
import only the builders and the house's low modules, so that the builders and the configuration
can read the tables. ``step`` and ``controls`` are the executor's.
"""

from __future__ import annotations

from functools import cache
from importlib import import_module
from importlib.util import find_spec
from types import ModuleType
from typing import Any

# One line a family: its folder. Where two step adapters could take a pipeline class, the
# first wins; the tables list their entries in this order.
FOLDERS: tuple[str, ...] = (
    "sd",
    "sdxl",
    "sd3",
    "flux",
    "flux2",
    "flux_kontext",
    "flux_fill",
    "hunyuandit",
    "qwen_image",
    "qwen_image_edit",
    "pixart",
    "sana",
    "z_image",
    "chroma",
    "wan",
    "ltx2",
    "hunyuan_video15",
)


BUILDER_PARTS = ("tiny", "architecture")


def having(part: str) -> list[str]:
    """The folders that have a module ``part`` (``step``, ``tiny``, ``architecture``,
    ``controls``), in folder order; the module itself is not imported."""
    return [folder for folder in FOLDERS if find_spec(f"{__name__}.{folder}.{part}") is not None]


def parts(part: str) -> list[ModuleType]:
    """Each folder's module ``part``, imported, in folder order, for the folders that have one."""
    return [import_module(f"{__name__}.{folder}.{part}") for folder in having(part)]


def _merged(part: str, table: str) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for module in parts(part):
        for key, value in getattr(module, table).items():
            if key in merged:
                raise ValueError(f"{key!r} is declared twice ({module.__name__})")
            merged[key] = value
    return merged


@cache
def embedded_models() -> dict[str, tuple[str, Any]]:
    """The tiny test models: name -> (description, builder(directory))."""
    return _merged("tiny", "EMBEDDED")


@cache
def architectures() -> dict[str, Any]:
    """The released architectures ``random:NAME`` builds: name -> its
    :class:`~diffserve.builders.random.parts.Architecture`."""
    return _merged("architecture", "ARCHITECTURES")


@cache
def controlnet_titles() -> tuple[str, ...]:
    """The families that take ControlNet models, by title (for messages)."""
    return tuple(import_module(f"{__name__}.{folder}").TITLE for folder in having("controls"))
