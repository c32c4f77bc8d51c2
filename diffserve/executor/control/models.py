"""The control models an executor serves (``--controlnet NAME=PATH``): loaded once beside the model,
on its device and in its dtype, each checked against the family (a ControlNet made for another
family's denoiser is refused, naming it), and described for ``/v1/models`` and the frontend's
checks (its kind, its union modes, what it costs a row)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from diffserve.wire.model_info import ControlModelInfo

log = logging.getLogger(__name__)


class ControlModelError(ValueError):
    """A control model this server cannot serve with its model."""


@dataclass
class ControlModel:
    name: str
    module: Any
    kind: str  # its class
    modes: int  # a union model's control types (0: not a union model)
    cost: float  # its parameters over the denoiser's: what it adds to a row's cost

    def info(self) -> ControlModelInfo:
        return ControlModelInfo(self.name, self.kind, self.modes, round(self.cost, 4))


class ControlModels:
    """The served control models by name, ready for the step engine and request mode."""

    def __init__(self, models: dict[str, ControlModel]) -> None:
        self.models = models

    def __getitem__(self, name: str) -> ControlModel:
        return self.models[name]

    def __bool__(self) -> bool:
        return bool(self.models)

    def describe(self) -> list[ControlModelInfo]:
        return [m.info() for m in self.models.values()]


def control_paths(config, loaded) -> dict[str, str]:
    """The control models to serve: the model directory's ``diffserve.json`` ``controlnets``
    (name -> a path relative to the model directory, or any --controlnet PATH), then the
    --controlnet flags (which win)."""
    from pathlib import Path

    from diffserve.builders.registry import resolve_model

    model_dir = Path(resolve_model(config.model))
    declared = {name: str(model_dir / path) if (model_dir / path).exists() else path
                for name, path in loaded.defaults.get("controlnets", {}).items()}
    return {**declared, **config.control_models}


def load_controls(paths: dict[str, str], family, device: str, dtype) -> ControlModels:
    """``paths`` (name -> a ControlNet directory, embedded name or hub id) loaded for ``family``
    (the step engine's family instance; None refuses every one). Raises
    :class:`ControlModelError` naming the flag, the model and why."""
    if not paths:
        return ControlModels({})
    from diffusers import AutoModel

    from diffserve.builders.registry import resolve_controlnet

    if family is None or not family.control_classes:
        raise ControlModelError(
            f"--controlnet: {family.name if family else 'this pipeline'} takes no control model "
            "here (ControlNet runs with Stable Diffusion 1.x/2.x, SDXL, Flux and Qwen-Image)")
    denoiser_params = sum(p.numel() for d in family.denoisers for p in d.parameters())
    models = {}
    for name, path in paths.items():
        flag = f"--controlnet {name}={path}"
        try:
            module = AutoModel.from_pretrained(resolve_controlnet(path), torch_dtype=dtype)
        except Exception as error:  # noqa: BLE001 - said as what it is
            raise ControlModelError(f"{flag}: not a model diffusers can load ({type(error).__name__}: "
                                    f"{error})") from None
        kind = type(module).__name__
        why = family.control_fits(module)
        if why:
            raise ControlModelError(f"{flag}: a {kind} that {why}; the model is "
                                    f"{family.name}")
        module.to(device).eval().requires_grad_(False)
        modes = int(getattr(module.config, "num_mode", None) or 0)
        cost = sum(p.numel() for p in module.parameters()) / max(denoiser_params, 1)
        models[name] = ControlModel(name, module, kind, modes, cost)
        log.info("serving control model %r (%s%s) from %s", name, kind,
                 f", {modes} union modes" if modes else "", path)
    depths = {family.control_depth(m.module) for m in models.values()}
    if len(depths) > 1:
        raise ControlModelError("--controlnet: these control models add residuals to different "
                                "blocks of the denoiser, so they cannot be stacked in one request; "
                                "serve models of the same depth")
    return ControlModels(models)
