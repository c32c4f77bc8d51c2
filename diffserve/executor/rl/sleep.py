"""Sleeping at level 1: the device's memory given to a trainer, every weight kept in host memory,
and every component put back where it was at the wake.

- **Where each component was** is read at the sleep, module by module: its own device (the
  executor's, or another that placement chose: ``--text-encoder-device``, ``--vae-device``), so
  that the wake puts it there again, not on the executor's device. A component that diffusers'
  group offloading streams (``--offload``) lives in host memory already and is left to its hooks.
  The control models (ControlNet) sleep and wake with the pipeline.
- **Large pinned copies.** A component's tensors go, dtype by dtype, into one pinned host buffer
  each (page-locked: the copies run asynchronously, at the link's speed, and none waits for the
  next), and come back from it.
- **Caches freed.** What the executor keeps on the device besides the weights (the prompt cache's
  encodings, the LoRA rows' gathered weights) is dropped at the sleep; the allocator's cached
  blocks go back to the device.

Level 2 (every weight dropped, reloaded at the wake) is :mod:`diffserve.executor.rl.weights`'.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)


def offloaded(module) -> bool:
    """Whether diffusers' group offloading streams ``module`` or its parts (leaf-level groups:
    the VAE's): its weights live on the host."""
    return any(getattr(sub, "_diffusers_hook", None) is not None
               and sub._diffusers_hook.get_hook("group_offloading") is not None
               for sub in module.modules())


def device_of(module):
    import torch

    first = next((t for t in (*module.parameters(), *module.buffers())), None)
    return first.device if first is not None else torch.device("cpu")


class HostCopy:
    """``module``'s tensors in pinned host memory, one buffer per dtype, each tensor a view of
    it (the module's tensors point there until :meth:`restore`)."""

    def __init__(self, module) -> None:
        import torch

        self.module, self.device = module, device_of(module)
        tensors = [*module.parameters(), *module.buffers()]
        pinned = torch.cuda.is_available()
        self.buffers, placed, by_dtype = {}, [], {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for dtype, group in by_dtype.items():
            buffer = torch.empty(sum(t.numel() for t in group), dtype=dtype, pin_memory=pinned)
            at = 0
            for tensor in group:
                view = buffer[at:at + tensor.numel()].view(tensor.shape)
                view.copy_(tensor.data, non_blocking=pinned)
                placed.append((tensor, view))
                at += tensor.numel()
            self.buffers[dtype] = buffer
        if pinned:
            torch.cuda.synchronize()
        for tensor, view in placed:  # the device's copies go once every copy is done
            tensor.data = view
        self.placed = placed

    def restore(self) -> None:
        import torch

        cuda = self.device.type == "cuda"
        for tensor, view in self.placed:
            tensor.data = view.to(self.device, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(self.device)
        self.placed, self.buffers = [], {}


class Sleep:
    """Level 1 of one executor: ``modules()`` gives the modules to put to sleep by name (the
    pipeline's components and the control models); ``caches`` are what is dropped (each with a
    ``clear()``)."""

    def __init__(self, modules: Callable[[], dict[str, Any]], caches: Callable[[], list]) -> None:
        self.modules, self.caches = modules, caches
        self.parked: dict[str, HostCopy] = {}

    def sleep(self) -> None:
        for name, module in self.modules().items():
            if offloaded(module) or device_of(module).type == "cpu":
                continue  # in host memory already
            self.parked[name] = HostCopy(module)
        for cache in self.caches():
            cache.clear()
        free()
        log.info("asleep (level 1): %s in host memory", ", ".join(self.parked) or "nothing moved")

    def wake(self) -> None:
        for copy in self.parked.values():
            copy.restore()
        self.parked = {}


def free() -> None:
    """The allocator's cached blocks (and what reference cycles still held) back to the device."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
