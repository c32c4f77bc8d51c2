"""Sleeping at level 1: the device's memory given to a trainer, every weight kept in host memory,
and every component put back where it was at the wake.

- **Where each component was** is read at the sleep, module by module: its own device (the
  executor's, or another that placement chose: ``--text-encoder-device``, ``--vae-device``), so
  that the wake puts it there again, not on the executor's device. A component that diffusers'
  group offloading streams (``--offload``) lives in host memory already and is left to its hooks.
  The control models (ControlNet) sleep and wake with the pipeline.
- **Pinned copies in chunks.** A component's tensors go, dtype by dtype, into pinned host buffers
  (page-locked: the copies run asynchronously, at the link's speed, and none waits for the next),
  and come back from them. torch's pinned allocator rounds every block up to a power of two and
  keeps it once freed: one buffer per dtype would take 32 GiB for 23.8 GB of weights and hold it
  after the wake. So tensors are packed, largest first, into chunks of a power-of-two capacity
  (:data:`CHUNK_BYTES`, or the next power of two above a larger tensor), and the wake gives the
  freed blocks back to the host.
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


CHUNK_BYTES = 512 << 20  # a pinned chunk's capacity: a power of two, as the allocator's blocks


def pack(sizes: list[int], chunk: int = CHUNK_BYTES) -> list[list[int]]:
    """Indices of tensors of ``sizes`` bytes packed into chunks, largest first, each into the
    first chunk with room (first fit decreasing); a chunk holds ``chunk`` bytes, or the next
    power of two above its first tensor where that is larger."""
    chunks: list[tuple[int, int, list[int]]] = []  # (capacity, used, indices)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for n, (capacity, used, members) in enumerate(chunks):
            if used + sizes[i] <= capacity:
                chunks[n] = (capacity, used + sizes[i], members + [i])
                break
        else:
            chunks.append((max(chunk, 1 << max(0, (sizes[i] - 1).bit_length())), sizes[i], [i]))
    return [members for _, _, members in chunks]


class HostCopy:
    """``module``'s tensors in pinned host memory, packed by dtype into chunks (:func:`pack`),
    each tensor a view of its chunk (the module's tensors point there until :meth:`restore`)."""

    def __init__(self, module, chunk: int = CHUNK_BYTES) -> None:
        from diffserve.device import current

        self.module, self.device = module, device_of(module)
        host = current()
        pinned = host.pinned
        self.buffers, placed, by_dtype = {}, [], {}
        for tensor in [*module.parameters(), *module.buffers()]:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for dtype, group in by_dtype.items():
            self.buffers[dtype] = []
            sizes = [t.numel() * t.element_size() for t in group]
            for members in pack(sizes, chunk):
                buffer = host.host_buffer(sum(group[i].numel() for i in members), dtype)
                at = 0
                for tensor in (group[i] for i in members):
                    view = buffer[at:at + tensor.numel()].view(tensor.shape)
                    view.copy_(tensor.data, non_blocking=pinned)
                    placed.append((tensor, view))
                    at += tensor.numel()
                self.buffers[dtype].append(buffer)
        if pinned:
            host.synchronize()
        for tensor, view in placed:  # the device's copies go once every copy is done
            tensor.data = view
        self.placed = placed

    def restore(self) -> None:
        """Every tensor back on its device; the pinned chunks freed and given back to the host
        (torch's allocator would keep them for a next pinned allocation)."""
        from diffserve.device import current, of

        self._back(of(self.device))
        self.placed, self.buffers = [], {}
        current().empty_host_cache()

    def _back(self, kind) -> None:
        """(Its own frame: no view of a chunk outlives it.)"""
        for tensor, view in self.placed:
            tensor.data = view.to(self.device, non_blocking=kind.queued, copy=True)
        kind.synchronize(self.device)


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
    from diffserve.device import current

    gc.collect()
    current().empty_cache()
