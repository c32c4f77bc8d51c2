"""Released architectures with random weights, a model source like any other:
``--model random:NAME`` (the published size) or ``random:NAME:tiny`` (the same structure with
fewer and narrower layers, for a CPU). Nothing is downloaded and no weight touches the disk. Each
architecture is declared in its family's folder (``architecture.py``,
:func:`diffserve.executor.families.architectures`).

:func:`resolve` writes the model's pipeline directory without weights (its index, each module's
config, tokenizers, scheduler, serving defaults, and :data:`MARKER` naming the modules to build)
under the cache directory, and the loader (:mod:`diffserve.executor.model.loading`) builds those
modules from their configs with random weights, on the device and in the dtype the server picks
(:func:`build`). Capacity planning, load tests and the GPU checks serve them over HTTP like any
model; ``/v1/models`` says ``random_weights: true``.
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from typing import Any

from diffserve.builders.random.parts import FULL, SCALES, TINY, Architecture
from diffserve.executor.families import architectures

PREFIX = "random:"
MARKER = "random_weights.json"  # in the skeleton: the modules to build, with their classes
_BUILD_VERSION = 1  # bump when an architecture's config changes


class RandomModelError(ValueError):
    """A ``random:`` spec that names no known architecture or scale."""


def is_random(spec: str) -> bool:
    return spec.startswith(PREFIX)


def parse(spec: str) -> tuple[str, str]:
    """(architecture, scale) of ``random:NAME[:tiny]``."""
    name, _, scale = spec[len(PREFIX):].partition(":")
    scale = scale or FULL
    if name not in architectures():
        raise RandomModelError(f"--model {spec!r}: no random architecture {name!r}; known: "
                               f"{', '.join(architectures())}")
    if scale not in SCALES:
        raise RandomModelError(f"--model {spec!r}: the scale {scale!r} is not one of "
                               f"{', '.join(SCALES)} (random:NAME, or random:NAME:tiny)")
    return name, scale


def resolve(spec: str, root: Path) -> str:
    """The skeleton directory of ``spec`` under ``root``, written first if it is not there
    (:func:`~diffserve.builders.embedded.built_in_place`)."""
    from diffserve.builders.embedded import built_in_place

    name, scale = parse(spec)
    target = root / "random" / f"{name}-{scale}-v{_BUILD_VERSION}"
    return str(built_in_place(target, MARKER, lambda staging: write_skeleton(
        architectures()[name], scale, staging)))


def write_skeleton(arch: Architecture, scale: str, directory: Path) -> None:
    """The pipeline directory of ``arch`` at ``scale``, without weights."""
    import diffusers

    from diffserve.builders.common import SERVING_DEFAULTS_FILE

    scratch = directory / "_scratch"
    others = arch.others(scale, scratch)
    cls = getattr(diffusers, arch.pipeline)
    optional = set(getattr(cls, "_optional_components", ()))
    index: dict[str, Any] = {
        n: [None, None] if n in optional else p.default
        for n, p in inspect.signature(cls.__init__).parameters.items()
        if n != "self" and p.kind is p.POSITIONAL_OR_KEYWORD}
    index = {n: v for n, v in index.items() if v is not inspect.Parameter.empty}
    index.update(arch.pipeline_config, _class_name=arch.pipeline,
                 _diffusers_version=diffusers.__version__)
    for name, obj in others.items():
        obj.save_pretrained(directory / name)
        index[name] = [type(obj).__module__.split(".")[0], type(obj).__name__]
    marker = {}
    for name, module in arch.modules.items():
        _write_config(module, module.config_at(scale, others), directory / name)
        # diffusers takes a passed optional component (Wan's transformer) only where the index
        # has none: it would look for its weights otherwise.
        index[name] = [None, None] if name in optional else [module.library, module.cls]
        marker[name] = {"library": module.library, "class": module.cls,
                        "config_class": module.config_class}
    shutil.rmtree(scratch, ignore_errors=True)
    (directory / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    (directory / SERVING_DEFAULTS_FILE).write_text(
        json.dumps(arch.defaults(scale), indent=2) + "\n")
    (directory / MARKER).write_text(json.dumps({"modules": marker, "scale": scale}, indent=2)
                                    + "\n")


def _write_config(module, config: dict[str, Any], directory: Path) -> None:
    """``module``'s config file, as its library writes it (a diffusers model built on the meta
    device, so that no weight is made)."""
    directory.mkdir(parents=True, exist_ok=True)
    if module.library == "transformers":
        import transformers

        getattr(transformers, module.config_class)(**config).save_pretrained(directory)
        return
    import torch

    with torch.device("meta"):
        model = diffusers_class(module.library, module.cls)(**config)
    model.save_config(directory)


def diffusers_class(library: str, name: str):
    """A diffusers class by the name a model index gives it: from the library itself, or from
    the pipeline's own package (LTX-2's connectors and vocoder: library ``ltx2``)."""
    from importlib import import_module

    import diffusers

    if library == "diffusers":
        return getattr(diffusers, name)
    return getattr(import_module(f"diffusers.pipelines.{library}"), name)


def marker(path: str) -> dict | None:
    """The skeleton's :data:`MARKER`, or None where ``path`` is no random model's directory."""
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def build(path: str, device: str, dtype) -> dict[str, Any]:
    """The modules a skeleton names, built from their configs with random weights (each from a
    fixed seed of its own) on ``device`` in ``dtype``; what the libraries keep in float32 when
    they load in half precision is kept so here too."""
    import diffusers
    import torch
    import transformers

    built = {}
    default = torch.get_default_dtype()
    for seed, (name, entry) in enumerate(sorted(marker(path)["modules"].items())):
        folder = Path(path) / name
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                if entry["library"] == "transformers":
                    config = getattr(transformers, entry["config_class"]).from_pretrained(folder)
                    module = getattr(transformers, entry["class"])(config)
                else:
                    cls = diffusers_class(entry["library"], entry["class"])
                    module = cls.from_config(cls.load_config(folder))
        finally:
            torch.set_default_dtype(default)
        module = module.to(device, dtype).eval()
        strict, lax = ({*(getattr(module, f"_keep_in_fp32_modules{x}", None) or ())}
                       for x in ("_strict", ""))
        keep = strict | (lax if isinstance(module, diffusers.ModelMixin)
                         or dtype == torch.float16 else set())
        for key, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if keep & {*key.split(".")}:
                tensor.data = tensor.data.float()
        built[name] = module
    return built


def names() -> list[str]:
    """Every ``random:`` spec there is."""
    return [f"{PREFIX}{name}{suffix}" for name in architectures() for suffix in ("", f":{TINY}")]
