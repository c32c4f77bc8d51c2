"""The start-up checks' verdicts, remembered per model and per code.

The checks (:mod:`diffserve.executor.checks.startup`) run a few short requests through the step
engine and the plain pipeline: seconds on a large model, paid again at every restart of every
executor although nothing they depend on changed. A verdict is kept in the cache directory
(``$DIFFSERVE_CACHE_DIR``, default ``~/.cache/diffserve``) under a key made of everything the
checks' outcome depends on:

- the model directory: every file's relative path, size and modification time; and the same of
  every control model's directory (an embedded or hub one by its name);
- diffserve's own source (a hash of every module of the package), and the versions of torch,
  diffusers, transformers, peft and torchao;
- the device: its type, and on a GPU its name and compute capability (kernels differ by card);
- the dtype, batching mode, tasks, offered samplers, accelerator and memory settings (the
  attention backend as chosen, ``auto`` resolved), LoRA adapters, and a parallel group's degrees
  (a group's forwards are not one device's).

Any change to one of them is a new key, so the checks run again. A hub id (a model that is no
local directory) is never remembered. Removing ``<cache>/startup-checks`` forgets every verdict.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import diffserve
from diffserve.builders.embedded import cache_root

log = logging.getLogger(__name__)

LIBRARIES = ("torch", "diffusers", "transformers", "peft", "torchao")


def _sha(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


@lru_cache(maxsize=1)
def _source_hash() -> str:
    root = Path(diffserve.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _versions() -> list[str]:
    out = []
    for name in LIBRARIES:
        try:
            out.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name}=-")
    return out


def _model_fingerprint(model_dir: Path) -> str:
    rows = []
    for path in sorted(model_dir.rglob("*")):
        if path.is_file():
            st = path.stat()
            rows.append(f"{path.relative_to(model_dir)}:{st.st_size}:{st.st_mtime_ns}")
    return _sha(*rows)


def key_for(model_dir: str, what: dict[str, Any]) -> str | None:
    """The verdict's key, or None where the model is no local directory."""
    path = Path(model_dir)
    if not path.is_dir():
        return None
    return _sha(_model_fingerprint(path), _source_hash(), *_versions(),
                json.dumps(what, sort_keys=True, default=str))


def key_of(rt, config) -> str | None:
    """The verdict's key for ``rt`` built from ``config`` (see the module's docstring)."""
    import torch

    from diffserve.device import of
    from diffserve.executor.memory.layout import MemoryLayout
    from diffserve.builders.registry import resolve_model

    device = torch.device(rt.loaded.device)
    card = of(device).describe(device)
    controls = {name: _model_fingerprint(Path(path)) if Path(path).is_dir() else path
                for name, path in _control_dirs(config, rt).items()}
    return key_for(resolve_model(config.model), {
        "device": device.type, **card, "dtype": rt.loaded.dtype, "mode": rt.mode,
        "requested": config.batching_mode, "tasks": sorted(rt.pipelines),
        "samplers": rt.info.schedulers, "compile": config.compile,
        "step_cache": config.step_cache, "quantization": config.quantization,
        "quantization_scope": config.quantization_scope, "compile_rows": config.compile_rows,
        "cuda_graphs": config.cuda_graphs,
        "attention": rt.speed.get("attention", {}).get("backend", "native"),
        "text_encoder_quantization": config.text_encoder_quantization,
        "layout": MemoryLayout.of(config).describe(), "degrees": vars(config.degrees),
        "adapters": sorted(config.lora_adapters.items()), "controls": controls})


def _control_dirs(config, rt) -> dict[str, str]:
    from diffserve.executor.control.models import control_paths
    from diffserve.builders.registry import resolve_controlnet

    return {name: resolve_controlnet(path) for name, path in control_paths(config, rt.loaded).items()}


def _file(key: str, kind: str) -> Path:
    return cache_root() / kind / f"{key}.json"


def recall(key: str | None, kind: str = "startup-checks") -> dict[str, Any] | None:
    """The verdict stored under ``key``, or None; ``kind``: what is remembered (the start-up
    checks' verdicts; the model FLOPs' fits in ``model-flops``)."""
    if key is None:
        return None
    try:
        return json.loads(_file(key, kind).read_text())
    except (OSError, ValueError):
        return None


def remember(key: str | None, verdict: dict[str, Any], kind: str = "startup-checks") -> None:
    """Store ``verdict`` under ``key``; written whole (a temporary file renamed into place) so
    that executors starting together never read half a verdict. A cache directory that cannot
    be written only costs the next start its checks."""
    if key is None:
        return
    target = _file(key, kind)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(dir=target.parent, prefix=".verdict-")
        with os.fdopen(fd, "w") as f:
            json.dump(verdict, f)
        os.replace(staging, target)
    except OSError as error:
        log.info("start-up check verdict not stored (%s)", error)
