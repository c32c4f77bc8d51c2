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
from typing import Any

from diffserve.control import BASE_VERSION, COMMIT, DISCARD, PREPARE, SLEEP, SYNC, WAKE, \
    WeightResult, WeightSource, WeightStep

from diffserve.executor.pipeline import denoisers, torch_modules

log = logging.getLogger(__name__)

class WeightError(ValueError):
    """An update that does not fit the model (400), or a state the executor cannot reach."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_weights") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def canonical(name: str) -> str:
    """A parameter's checkpoint key: without PEFT's ``base_layer`` and torch.compile's wrapper."""
    return name.replace(".base_layer.", ".").replace("_orig_mod.", "")


def is_adapter_weight(name: str) -> bool:
    return "lora_" in name


class Weights:
    def __init__(self, pipe, model_path: str, device: str, dtype: str) -> None:
        """``pipe``: the served pipeline; ``model_path``: where --model's files are (what SYNC
        and a wake from level 2 reload)."""
        self.pipe, self.model_path, self.device, self.dtype = pipe, model_path, device, dtype
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

    def read(self, source: WeightSource) -> dict[str, dict[str, Any]]:
        """The source's tensors (on the host), by denoiser."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

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
        tensors: dict[str, dict[str, Any]] = {}
        for name, files in layout.items():
            if not files:
                raise WeightError(f"no .safetensors file for the {name} in {source.path!r}")
            state = tensors.setdefault(name, {})
            for file in files:
                try:
                    state.update(load_file(str(file)))
                except (SafetensorError, OSError, ValueError) as error:
                    raise WeightError(f"{file.name} could not be read as safetensors: "
                                      f"{error}") from None
        return tensors

    def check(self, tensors: dict[str, dict[str, Any]]) -> bool:
        """Refuse what does not fit (naming the first offending key); whether the tensors hold
        every weight of every denoiser."""
        denoisers, full = self.denoisers(), True
        for name, module in denoisers.items():
            params, state = self.params(module), tensors.get(name, {})
            shapes = self._shapes.get(name, {})
            for key, tensor in state.items():
                param = params.get(key)
                if param is None:
                    raise WeightError(f"{name}: {key!r} is not a weight of the model's {name}")
                shape, dtype = shapes.get(key, (tuple(param.shape), param.dtype))
                if tuple(tensor.shape) != shape:
                    raise WeightError(f"{name}: {key!r} has shape {list(tensor.shape)}, the "
                                      f"model's is {list(shape)}")
                if tensor.is_floating_point() != dtype.is_floating_point:
                    raise WeightError(f"{name}: {key!r} is {tensor.dtype}, the model's is {dtype}")
            full &= set(state) >= set(params)
        return full

    def prepare(self, source: WeightSource) -> bool:
        """Read and check ``source``, kept until COMMIT or DISCARD; whether it is full."""
        tensors = self.read(source)
        full = self.check(tensors)
        self.staged = (source, tensors, full)
        return full

    def commit(self, version: str) -> None:
        """Apply what PREPARE kept (asleep at level 2: at the wake, with the others)."""
        if self.staged is None:
            raise WeightError("nothing was prepared to commit", 409, "no_update_prepared")
        source, tensors, full = self.staged
        if self.sleeping != 2:
            self._copy(tensors)
        self.sources = [source] if full else [*self.sources, source]
        self.version, self.staged = version, None

    def discard(self) -> None:
        self.staged = None

    def _copy(self, tensors: dict[str, dict[str, Any]]) -> None:
        import torch

        denoisers = self.denoisers()
        with torch.no_grad():
            for name, state in tensors.items():
                params = self.params(denoisers[name])
                for key, tensor in state.items():
                    params[key].copy_(tensor)

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
            tensors = self.read(source)
            self.check(tensors)
            self._copy(tensors)
        self.sources, self.version = list(sources), version

    def _reload(self, modules: dict[str, Any]) -> None:
        """``modules``' weights from --model's files, into the same parameters."""
        import torch
        from diffusers import DiffusionPipeline

        from diffserve.executor.model.compat import allow_processors_without_torchvision

        allow_processors_without_torchvision()
        skip = {name: None for name in self.modules() if name not in modules}
        try:
            fresh = DiffusionPipeline.from_pretrained(self.model_path, dtype=getattr(torch, self.dtype),
                                                      **skip)
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
        """Level 1: every weight to host memory (on a GPU); level 2: every weight dropped (what
        wakes reloads is the current version). The device's cached memory goes back."""
        import torch

        if self.sleeping:
            return
        if level == 1:
            if torch.device(self.device).type != "cpu":
                for module in self.modules().values():
                    module.to("cpu")
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
            import torch

            if torch.device(self.device).type != "cpu":
                for module in self.modules().values():
                    module.to(self.device)
        elif self.sleeping == 2:
            sources, version = self.sources, self.version
            self.sleeping = 0
            self._reload(self.modules())
            self.sources, self.version = [], BASE_VERSION
            self.sync(sources, version)
            self._shapes = {}
        self.sleeping = 0

    def _free(self) -> None:
        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


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
