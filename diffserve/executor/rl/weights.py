"""Weights that change while the executor serves (docs/rl.md): an update's tensors read and
checked against the denoiser (PREPARE), copied into its parameters in place between two steps or
calls (COMMIT: the same Parameter objects, so PEFT layers, compiled graphs and the step cache
keep holding them), the whole state rebuilt from the model's files and each update in order
(SYNC: a restarted executor, a commit undone because another executor failed it, a wake from
level 2), and sleeping to give the device to a trainer.

An update names the denoiser's weights by their checkpoint keys (what ``state_dict()`` of the
plain diffusers model gives); a PEFT-wrapped layer's ``base_layer`` is the same weight, and the
adapters' own LoRA weights are never touched. Floating-point tensors are cast to the
parameter's dtype as they are copied; a shape that differs, an unknown key or a non-float tensor
for a float weight is refused, naming the first such key, before anything changes.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from diffserve.wire.weight_commands import BASE_VERSION, COMMIT, DISCARD, PREPARE, SLEEP, SYNC, WAKE, \
    WeightResult, WeightSource, WeightStep

from diffserve.executor.pipeline import denoisers, torch_modules
from diffserve.executor.rl.sleep import Sleep, free
from diffserve.builders import random as random_weights

log = logging.getLogger(__name__)

class WeightError(ValueError):
    """An update that does not fit the model (400), or a state the executor cannot reach."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_weights") -> None:
        super().__init__(message)
        self.status, self.code = status, code


# safetensors' dtype names, as torch's
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def canonical(name: str) -> str:
    """A parameter's checkpoint key: without PEFT's ``base_layer`` and torch.compile's wrapper."""
    return name.replace(".base_layer.", ".").replace("_orig_mod.", "")


def is_adapter_weight(name: str) -> bool:
    return "lora_" in name


class Weights:
    def __init__(self, pipe, model_path: str, device: str, dtype: str, others=lambda: {},
                 caches=lambda: []) -> None:
        """``pipe``: the served pipeline; ``model_path``: where --model's files are (what SYNC
        and a wake from level 2 reload); ``others()``: modules beside the pipeline that sleep
        with it (the control models), by name; ``caches()``: what a sleep drops."""
        self.pipe, self.model_path, self.device, self.dtype = pipe, model_path, device, dtype
        self._level1 = Sleep(lambda: {**self.modules(), **others()}, caches)
        self.version = BASE_VERSION
        self.sources: list[WeightSource] = []  # since the model's own weights, in order
        self.staged: tuple[WeightSource, dict, bool] | None = None  # prepared, not committed
        self.sleeping = 0
        self._shapes: dict[str, dict[str, tuple]] = {}  # level 2: what each freed weight was

    # -- what the model holds --------------------------------------------------------------

    def modules(self) -> dict[str, Any]:
        return torch_modules(self.pipe)

    def denoisers(self) -> dict[str, Any]:
        return denoisers(self.pipe)

    @staticmethod
    def params(module) -> dict[str, Any]:
        """The module's own weights by checkpoint key (not an adapter's)."""
        return {canonical(name): p for name, p in module.named_parameters()
                if not is_adapter_weight(name)}

    # -- an update ---------------------------------------------------------------------------

    def read(self, source: WeightSource) -> dict[str, list[tuple[Path, dict[str, tuple]]]]:
        """The source's manifest, by denoiser: each safetensors file with its keys' (shape,
        dtype), read off the files' headers: no tensor is loaded until COMMIT streams them in,
        one at a time (a rank never holds a whole update in host memory)."""
        import torch
        from safetensors import SafetensorError, safe_open

        path, denoisers = Path(source.path), self.denoisers()
        if path.is_file():
            layout = {None: [path]}
        elif not path.is_dir():
            raise WeightError(f"{source.path!r} does not exist")
        elif any((path / name).is_dir() for name in denoisers):  # diffusers' layout
            layout = {name: sorted((path / name).glob("*.safetensors")) for name in denoisers
                      if (path / name).is_dir()}
        else:
            layout = {None: sorted(path.glob("*.safetensors"))}
        if None in layout:  # a state dict: of the one denoiser
            if len(denoisers) != 1:
                raise WeightError(f"the model has {len(denoisers)} denoisers "
                                  f"({', '.join(denoisers)}): give a directory in diffusers' "
                                  "layout, a folder per denoiser")
            layout = {next(iter(denoisers)): layout[None]}
        manifest: dict[str, list[tuple[Path, dict[str, tuple]]]] = {}
        for name, files in layout.items():
            if not files:
                raise WeightError(f"no .safetensors file for the {name} in {source.path!r}")
            for file in files:
                try:
                    with safe_open(str(file), framework="pt") as f:
                        keys = {key: (tuple(f.get_slice(key).get_shape()),
                                      getattr(torch, SAFETENSORS_DTYPES.get(
                                          f.get_slice(key).get_dtype(), "uint8")))
                                for key in f.keys()}
                except (SafetensorError, OSError, ValueError) as error:
                    raise WeightError(f"{file.name} could not be read as safetensors: "
                                      f"{error}") from None
                manifest.setdefault(name, []).append((file, keys))
        return manifest

    def check(self, manifest: dict[str, list[tuple[Path, dict[str, tuple]]]]) -> bool:
        """Refuse what does not fit (naming the first offending key); whether the update holds
        every weight of every denoiser."""
        denoisers, full = self.denoisers(), True
        for name, module in denoisers.items():
            params, shapes, keys = self.params(module), self._shapes.get(name, {}), set()
            for _, entries in manifest.get(name, []):
                for key, (shape, theirs) in entries.items():
                    param = params.get(key)
                    if param is None:
                        raise WeightError(f"{name}: {key!r} is not a weight of the model's {name}")
                    mine, dtype = shapes.get(key, (tuple(param.shape), param.dtype))
                    if shape != mine:
                        raise WeightError(f"{name}: {key!r} has shape {list(shape)}, the "
                                          f"model's is {list(mine)}")
                    if theirs.is_floating_point != dtype.is_floating_point:
                        raise WeightError(f"{name}: {key!r} is {theirs}, the model's is {dtype}")
                    keys.add(key)
            full &= keys >= set(params)
        return full

    def prepare(self, source: WeightSource) -> bool:
        """Read and check ``source``'s manifest, kept until COMMIT or DISCARD; whether it is
        full."""
        manifest = self.read(source)
        full = self.check(manifest)
        self.staged = (source, manifest, full)
        return full

    def commit(self, version: str) -> None:
        """Apply what PREPARE kept (asleep at level 2: at the wake, with the others)."""
        if self.staged is None:
            raise WeightError("nothing was prepared to commit", 409, "no_update_prepared")
        source, manifest, full = self.staged
        if self.sleeping != 2:
            self._copy(manifest)
        self.sources = [source] if full else [*self.sources, source]
        self.version, self.staged = version, None

    def discard(self) -> None:
        self.staged = None

    def _copy(self, manifest: dict[str, list[tuple[Path, dict[str, tuple]]]]) -> None:
        """Each tensor of the update read from its file and copied into its parameter in turn
        (cast to the parameter's dtype), so that the host holds one tensor at a time."""
        import torch
        from safetensors import safe_open

        denoisers = self.denoisers()
        with torch.no_grad():
            for name, files in manifest.items():
                params = self.params(denoisers[name])
                for file, keys in files:
                    with safe_open(str(file), framework="pt") as f:
                        for key in keys:
                            params[key].copy_(f.get_tensor(key))

    # -- a whole state -----------------------------------------------------------------------

    def sync(self, sources: list[WeightSource], version: str) -> None:
        """Hold exactly the model's weights and then ``sources``, in order, as ``version``."""
        if version == self.version and list(sources) == self.sources:
            return
        self.staged = None
        if self.sleeping == 2:  # nothing is held: the wake reloads it all
            self.sources, self.version = list(sources), version
            return
        self._reload(self.denoisers())
        for source in sources:
            manifest = self.read(source)
            self.check(manifest)
            self._copy(manifest)
        self.sources, self.version = list(sources), version

    def _reload(self, modules: dict[str, Any]) -> None:
        """``modules``' weights from --model's files, into the same parameters."""
        import torch
        from diffusers import DiffusionPipeline

        from diffserve.builders.compat import allow_processors_without_torchvision

        allow_processors_without_torchvision()
        skip = {name: None for name in self.modules() if name not in modules}
        try:
            if random_weights.marker(self.model_path) is not None:  # its seeds, not its files
                fresh = SimpleNamespace(components=random_weights.build(
                    self.model_path, "cpu", getattr(torch, self.dtype)))
            else:
                fresh = DiffusionPipeline.from_pretrained(
                    self.model_path, dtype=getattr(torch, self.dtype), **skip)
        except Exception as error:  # noqa: BLE001 - said as what it is
            raise WeightError(f"the model's own weights could not be read again from "
                              f"{self.model_path}: {type(error).__name__}: {error}", 500,
                              "reload_failed") from None
        with torch.no_grad():
            for name, module in modules.items():
                theirs = dict(fresh.components[name].named_parameters())
                for key, param in self.params(module).items():
                    if param.numel() == 0 and key in self._shapes.get(name, {}):
                        shape, dtype = self._shapes[name][key]
                        param.data = torch.empty(shape, dtype=dtype, device=param.device)
                    param.copy_(theirs[key])
        del fresh
        gc.collect()

    # -- sleeping ----------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Level 1: every weight to host memory, each component back where it was at the wake
        (:mod:`diffserve.executor.rl.sleep`); level 2: every weight dropped (what the wake
        reloads is the current version). The device's cached memory goes back."""
        import torch

        if self.sleeping:
            return
        if level == 1:
            self._level1.sleep()
        else:
            for name, module in self.modules().items():
                shapes = self._shapes.setdefault(name, {})
                for key, param in self.params(module).items():
                    shapes[key] = (tuple(param.shape), param.dtype)
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.sleeping = level
        self._free()

    def wake(self) -> None:
        if self.sleeping == 1:
            self._level1.wake()
        elif self.sleeping == 2:
            sources, version = self.sources, self.version
            self.sleeping = 0
            self._reload(self.modules())
            self.sources, self.version = [], BASE_VERSION
            self.sync(sources, version)
            self._shapes = {}
        self.sleeping = 0

    def _free(self) -> None:
        free()


def run_step(weights: Weights | None, step: WeightStep) -> WeightResult:
    """One step of a command on this executor, as its answer."""
    if weights is None:
        return WeightResult(step.command_id, 404, "weight updates are off on this server "
                            "(--enable-weight-updates)", "not_enabled")
    try:
        full = False
        if step.step == PREPARE:
            full = weights.prepare(step.sources[0])
        elif step.step == COMMIT:
            weights.commit(step.version)
        elif step.step == DISCARD:
            weights.discard()
        elif step.step == SYNC:
            weights.sync(step.sources, step.version)
        elif step.step == SLEEP:
            weights.sleep(step.level)
        elif step.step == WAKE:
            weights.wake()
        else:
            raise WeightError(f"unknown weight step {step.step!r}")
    except WeightError as error:
        log.warning("weights %s refused: %s", step.step, error)
        return WeightResult(step.command_id, error.status, str(error), error.code,
                            weights.version, sleeping=weights.sleeping)
    except Exception as error:  # noqa: BLE001 - the executor keeps serving what it holds
        log.exception("weights %s failed", step.step)
        return WeightResult(step.command_id, 500, f"{type(error).__name__}: {error}",
                            "update_failed", weights.version, sleeping=weights.sleeping)
    return WeightResult(step.command_id, version=weights.version, applied_at=time.time(),
                        sleeping=weights.sleeping, full=full)
