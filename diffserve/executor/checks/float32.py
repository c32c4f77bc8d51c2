"""The float32 image a half-precision model's start-up check is judged against.

In bfloat16 or float16 the plain pipeline is itself some way from what the model computes in
float32, and kernels change with the batch size, so the step engine cannot be held to 2/255 of
it. The start-up check instead runs the plain pipeline once in float32 and asks that the step
engine be no further from that image than the half-precision plain pipeline is
(:mod:`diffserve.executor.checks.startup`).

The float32 run upcasts the pipeline's weights in place, parameter by parameter, and puts each
back in its own dtype afterwards: the same Parameter objects (which adapters, compiled graphs and
the step cache hold) with the same values, since a half-precision value is exact in float32. For
the duration the weights take twice their memory on the device; where that does not fit, the
reference runs with the components on the CPU. Quantized weights (torchao tensors) are left as
they are.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

from diffserve.device import current, of
from diffserve.executor.memory.oom import OOM_MESSAGES
from diffserve.executor.pipeline import torch_modules

log = logging.getLogger(__name__)


def _tensors(module):
    yield from module.parameters()
    yield from module.buffers()


@contextmanager
def in_float32(pipe, device=None):
    """``pipe`` computing in float32 (on ``device`` if given, else where it is) for the block;
    every weight back in its dtype and place afterwards."""
    import torch

    saved = []
    try:
        for module in torch_modules(pipe).values():
            for tensor in _tensors(module):
                if type(tensor.data) is not torch.Tensor:  # a quantized weight keeps its form
                    continue
                saved.append((tensor, tensor.data.dtype, tensor.data.device))
                if tensor.is_floating_point():
                    tensor.data = tensor.data.to(device or tensor.data.device, torch.float32)
                elif device is not None:
                    tensor.data = tensor.data.to(device)
        yield pipe
    finally:
        for tensor, dtype, place in saved:
            tensor.data = tensor.data.to(place, dtype)
        current().empty_cache()


@contextmanager
def reference(rt, device=None):
    """``rt``'s model in float32 (:func:`in_float32`) with the kernels a float32 input takes:
    native attention in place of a half-only kernel, and the compiled blocks' own forwards (one
    run needs no float32 graphs of its own)."""
    from contextlib import nullcontext

    from diffserve.executor.accel.attention import native_for

    compiled = getattr(rt, "compiled", None)
    with native_for(rt), compiled.eager() if compiled is not None else nullcontext(), \
            in_float32(rt.loaded.pipe, device) as pipe:
        yield pipe


def extra_bytes(pipe) -> int:
    """What upcasting the pipeline's half-precision weights to float32 adds."""
    import torch

    return sum(t.numel() * (4 - t.element_size()) for m in torch_modules(pipe).values() for t in _tensors(m)
               if type(t.data) is torch.Tensor and t.is_floating_point() and t.element_size() < 4)


DEVICE, HOST = "device", "host"  # where the float32 reference runs
SKIP = "skip"  # nowhere: it fits neither the device nor the host's memory
HOST_SHARE = 0.8  # of the host's available memory the float32 weights may take


def host_bytes(pipe) -> int:
    """What the float32 reference on the host holds there: every weight it moves, in float32
    (quantized weights stay where they are)."""
    import torch

    return sum(t.numel() * max(4, t.element_size()) if t.is_floating_point() else
               t.numel() * t.element_size()
               for m in torch_modules(pipe).values() for t in _tensors(m)
               if type(t.data) is torch.Tensor and t.device.type != "cpu")


def host_available() -> int | None:
    """The host's available memory (``MemAvailable``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_shortfall(needed: int, available: int | None) -> str | None:
    """Why ``needed`` bytes cannot go to the host's ``available`` memory, or None where they fit
    within :data:`HOST_SHARE` (None available: not known, not refused)."""
    if available is None or needed <= available * HOST_SHARE:
        return None
    return (f"the float32 reference needs {needed / 1e9:.1f} GB on the host, which has "
            f"{available / 1e9:.1f} GB available (at most {HOST_SHARE:.0%} of it taken)")


def fits(extra: int, free: int | None) -> bool:
    """Whether ``extra`` bytes of float32 weights fit in ``free`` bytes (None: no limit), the
    rest left to the call's own activations."""
    return free is None or extra < free * 0.9


def room(device, cap: int = 0) -> int | None:
    """The bytes ``device`` can still give this executor: its free memory, less what a cap
    leaves (``cap``: --device-memory-bytes or --gpu-memory-utilization's share, 0 for none; and
    the process's own memory fraction, where one is set). None off CUDA (the host's memory is
    not counted here)."""
    card = of(device)
    memory = card.free_total(device)
    if memory is None:
        return None
    free, total = memory
    held = card.reserved(device)
    fraction = card.memory_fraction(device)
    limits = [free, int(fraction * total) - held] + ([cap - held] if cap else [])
    return max(0, min(limits))


def place(rt, cap: int = 0) -> str:
    """Where the float32 reference of ``rt``'s half-precision model runs: on its device where the
    upcast weights fit in :func:`room`, else on the host. Asked once per start, for the main
    check and the sampler check alike; a parallel group's leader answers for every rank (their
    collectives must meet in the same forwards)."""
    pipe, on_host = rt.loaded.pipe, str(rt.loaded.device).startswith("cpu")
    where = DEVICE if fits(extra_bytes(pipe), room(rt.loaded.device, cap)) else HOST
    # The host's memory bounds both a model served there and one whose reference moves there:
    # past it the check is skipped rather than the host taken down.
    why = host_shortfall(extra_bytes(pipe) if on_host else host_bytes(pipe), host_available()) \
        if where == HOST or on_host else None
    where = SKIP if why is not None else where
    if rt.group is not None:
        where = rt.group.broadcast(where)
    if where == HOST:
        log.info("start-up check: the float32 reference does not fit on %s; it runs on the CPU",
                 rt.loaded.device)
    elif where == SKIP:
        log.warning("start-up check: skipped, the step engine served unjudged: %s",
                    why or "the group's leader found no room for the float32 reference")
    return where


def run(rt, requests: list, plain, where: str = DEVICE) -> dict:
    """``plain(rt, request)`` (an outcome) for each request with the model in float32: request id
    -> outcome. On the host where :func:`place` says so, or where the cast or the call still runs
    out of memory on the device; None where it cannot run (``SKIP``, or out of memory on the
    device with no room on the host)."""
    if where == SKIP:
        return None
    from diffserve.executor.memory.oom import is_out_of_memory, release

    found = None
    if where == DEVICE:
        try:
            with reference(rt):
                found = {r.request_id: plain(rt, r) for r in requests}
        except Exception as error:  # noqa: BLE001 - the cast itself may not fit
            if not is_out_of_memory(error):
                raise
            release(error)
    if found is not None and not any(m in (o.error or "") for o in found.values()
                                      for m in ("OutOfMemoryError", *OOM_MESSAGES)):
        return found
    if where == DEVICE:
        why = host_shortfall(host_bytes(rt.loaded.pipe), host_available())
        if why is not None:
            log.warning("start-up check: the float32 reference ran out of memory on %s and %s; "
                        "the step engine is served unjudged", rt.loaded.device, why)
            return None
        log.info("start-up check: the float32 reference ran out of memory on %s; it runs on the "
                 "CPU", rt.loaded.device)
    with reference(rt, "cpu"):
        return {r.request_id: plain(rt, r) for r in requests}
