"""The device layer: every question diffserve asks of a device, answered by one implementation
per kind (vLLM's ``platforms/``). ``base.Device`` is the interface, ``cpu.CpuDevice`` and
``cuda.CudaDevice`` the kinds, ``fake.FakeCuda`` a CUDA-like kind that runs on the CPU for tests.

- :func:`of` gives the kind that answers for a device (``"cuda:1"``, ``torch.device("cpu")``):
  memory statistics, streams and events, synchronisation, its name and compute capability.
- :func:`current` is the process's accelerator, chosen once: CUDA where torch sees a GPU, else
  the CPU. It answers what no device names: pinned host memory, emptying the allocator's cache,
  the visible device count.
- ``choice`` resolves ``--device`` (spreading executors over the visible GPUs) and makes a
  device current; ``stats`` reads a device's clock and memory.

Importing this package does not import torch (the frontend and scheduler count GPUs through
``choice.visible_gpus``); a kind is imported when first asked for. The CUDA calls are written in
``cuda.py`` alone (tests/device/test_one_layer.py holds the package to it).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from diffserve.device.base import Device

_kinds: dict[str, "Device"] = {}  # torch device type -> the implementation answering for it
_current: "Device | None" = None


def kind_of(device) -> str:
    """The torch device type of ``device`` (a string such as ``cuda:1``, or a torch.device)."""
    return getattr(device, "type", None) or str(device).split(":")[0]


def _default(kind: str) -> "Device":
    if kind == "cuda":
        from diffserve.device.cuda import CudaDevice

        return CudaDevice()
    from diffserve.device.cpu import CpuDevice  # any other kind: work done when its call returns

    return CpuDevice()


def of(device) -> "Device":
    """The implementation that answers for ``device``."""
    kind = kind_of(device)
    if kind not in _kinds:
        _kinds[kind] = _default(kind)
    return _kinds[kind]


def current() -> "Device":
    """The process's accelerator, chosen on first use: CUDA where a GPU is visible, else the CPU."""
    global _current
    if _current is None:
        cuda = of("cuda")
        _current = cuda if cuda.available() else of("cpu")
    return _current


@contextmanager
def installed(device: "Device") -> Iterator["Device"]:
    """``device`` answers for its kind and is the process's current device inside the block (a
    fake GPU for the CPU tests); the previous answers come back after it."""
    global _current
    saved_kind, saved_current = _kinds.get(device.kind), _current
    _kinds[device.kind], _current = device, device
    try:
        yield device
    finally:
        _current = saved_current
        if saved_kind is None:
            _kinds.pop(device.kind, None)
        else:
            _kinds[device.kind] = saved_kind
