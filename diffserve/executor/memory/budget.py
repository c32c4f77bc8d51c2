"""Admission by measured memory (``--gpu-memory-utilization``, ``--device-memory-bytes``;
docs/memory.md): at start the executor measures what its model holds and what a request takes,
and turns the budget into a bound on cost, the unit the scheduler already admits by.

- **Held**: on CUDA, what the allocator holds once the model is loaded and warmed up (weights,
  offload buffers, compiled graphs, and the CUDA graphs' private pools as the warm-up measured
  them); on a CPU, the bytes of every weight and buffer.
- **Per cost**: one generation of one image at the native size and the model's default guidance,
  then of two (one step each, the prompt encoding and the decode included), through the plain
  pipeline: the growth from one image to two, per unit of cost (:mod:`diffserve.wire.costs`), and the
  rest as a fixed part (a call that fails stops the start; where the second image shows no
  growth, the whole two-image call is counted as the images'). On CUDA the allocator's peak; on a
  CPU an estimate: the bytes of every module's outputs in the call (an upper bound: freed tensors
  count too). With a step cache, what an image's cache keeps (read off a real cache after one
  step: the first block's image-stream signal and the remaining blocks' output, every row) is
  added to the per-cost bytes; with encode and decode stages beside the loop, the decoder's
  bytes for one forward's images are added to the fixed part (a decode runs beside the next
  forward); the prompt cache's budget is held. Other sizes are priced by their cost, which is
  proportional to their latent pixels.
- **The bound**: ``(budget - held - fixed) / per cost``. It caps ``--max-batch-cost`` (one
  forward) and ``--max-running-cost`` (every set an executor holds) where it is the smaller; the
  executor decides it at start, and the scheduler's placement admits by it as by the configured
  bounds. A request that costs more than it is refused 400 ``exceeds_memory_budget``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from diffserve.config.flags import ConfigError
from diffserve.executor.pipeline import torch_modules
from diffserve.executor.tensors import module_bytes, nbytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measured:
    held: int  # bytes the executor holds once loaded
    fixed: int  # bytes a call takes whatever its size
    per_cost: float  # bytes per unit of cost


def budget_of(config, device: str) -> int:
    """The budget in bytes (0: none)."""
    from diffserve.device import of

    budgets = []
    if config.device_memory_bytes:
        budgets.append(config.device_memory_bytes)
    if config.gpu_memory_utilization:
        total = of(device).total(device)
        if total is None:
            raise ConfigError(f"--gpu-memory-utilization is a share of a GPU's memory; this "
                              f"executor runs on {device}: use --device-memory-bytes")
        budgets.append(int(config.gpu_memory_utilization * total))
    return min(budgets) if budgets else 0


class OutputBytes:
    """On a CPU: the bytes of every module's outputs while it is open (forward hooks)."""

    def __init__(self, modules) -> None:
        self.total, self.handles = 0, []
        for module in modules:
            for sub in module.modules():
                self.handles.append(sub.register_forward_hook(self._count))

    def _count(self, module, args, output) -> None:
        self.total += nbytes(output)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def measure(rt) -> Measured:
    """What the loaded model holds and what a generation takes (see the module's docstring)."""

    from diffserve.device.stats import DeviceStats

    info, pipe = rt.info, rt.loaded.pipe
    modules = [*torch_modules(pipe).values(),  # and the control models beside them
               *(m.module for m in (rt.controls.models.values() if rt.controls else ()))]
    stats = DeviceStats(rt.loaded.device)
    held = (stats.allocated() if stats.counted else sum(module_bytes(m)[1] for m in modules))
    held += rt.config.prompt_cache_bytes if rt.prompt_cache is not None else 0
    taken, decoded = {}, {}
    for images in (1, 2):
        taken[images], decoded[images] = _generation(rt, stats, modules, images)
    unit = unit_cost(info)
    growth = taken[2] - taken[1]
    # Growth from one image to two is what an image adds; where none shows (the allocator reused
    # what the first call freed), every byte of the two-image call is counted as the images'.
    per_cost = growth / unit if growth > 0 else taken[2] / (2 * unit)
    fixed = max(taken[1] - int(per_cost * unit), 0)
    if rt.step_cache is not None:  # what an image's step cache keeps while it runs
        per_cost += cached_bytes(rt) / unit
    if rt.threaded_stages:  # a decode runs beside the next forward: the images of one forward's
        per_image = max(decoded[2] - decoded[1], decoded[1], 0)
        fixed += int(per_image * info.max_batch_cost / unit)
    if rt.compiled is not None:  # CUDA graphs' private pools, as the warm-up recorded them
        held += rt.compiled.graph_bytes
    return Measured(held, fixed, per_cost)


def _generation(rt, stats, modules, images: int) -> tuple[int, int]:
    """(bytes a one-step generation of ``images`` native images takes, bytes its decode takes):
    on CUDA the allocator's peaks, on a CPU the bytes of every module's outputs. A call that
    fails leaves nothing to measure by: the start stops, saying why."""
    from diffserve.wire.request import ImageRequest, Work, WorkItem

    info = rt.info
    request = ImageRequest(f"memory-{images}", info.name, info.width, info.height,
                           num_inference_steps=1, guidance_scale=info.default_guidance_scale,
                           prompt="a measure of memory", n=images, num_frames=info.num_frames)
    counter = None if stats.counted else OutputBytes(modules)
    decode = DecodeBytes(rt.loaded.pipe, stats, counter)
    base = stats.start()
    try:
        (outcome,) = rt.request_runner().execute(Work(0, [WorkItem(request, 0, images)]), [[]])
    finally:
        decode.close()
        if counter is not None:
            counter.close()
    if outcome.error:
        raise ConfigError(f"the memory budget could not be measured: a generation of {images} "
                          f"native image(s) failed: {outcome.error}")
    return (stats.peak(base) if stats.counted else counter.total), decode.bytes


class DecodeBytes:
    """The bytes the VAE's decoder takes in a call: on CUDA its peak above what was allocated as
    it started, on a CPU the bytes of its modules' outputs (``counter``'s share of them)."""

    def __init__(self, pipe, stats, counter) -> None:
        self.bytes, self.stats, self.counter, self._base = 0, stats, counter, None
        decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
        self.handles = [] if decoder is None else [
            decoder.register_forward_pre_hook(self._before),
            decoder.register_forward_hook(self._after)]

    def _before(self, module, args) -> None:
        self._base = self.stats.start() if self.stats.counted else self.counter.total

    def _after(self, module, args, output) -> None:
        if self.stats.counted:
            self.bytes += self.stats.peak(self._base)
        else:
            self.bytes += self.counter.total - self._base

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def cached_bytes(rt) -> float:
    """What one image's step cache keeps (the first block's signal and the remaining blocks'
    cached output, for each of its rows, as the step cache stores them), read off a real cache
    after one step of a native-size request."""
    from diffserve.wire.request import ImageRequest, WorkItem

    info = rt.info
    request = ImageRequest("memory-cache", info.name, info.width, info.height,
                           num_inference_steps=3, guidance_scale=info.default_guidance_scale,
                           prompt="a measure of memory", num_frames=info.num_frames,
                           cache_threshold=1.0)
    engine = rt.step_engine()
    try:
        engine.admit([WorkItem(request, 0, 1)], [[]])
        engine.step()
        kept = sum(u.cache.nbytes for u in engine.units if u.cache is not None)
    finally:
        engine.abandon("measured")
        engine.close()
    return float(kept)


def unit_cost(info) -> float:
    """The cost of one image at the native size and the model's default guidance."""
    from diffserve.wire.costs import image_cost, uses_cfg

    return image_cost(1, 1, 1, 1, uses_cfg(info.guidance_rule, info.default_guidance_scale, ""))


def bound(rt, config) -> None:
    """Measure, and cap the cost bounds of ``rt.info`` by the budget (where there is one)."""
    budget = budget_of(config, rt.loaded.device)
    if not budget:
        return
    m = measure(rt)
    info = rt.info
    left = budget - m.held - m.fixed
    allowed = left / m.per_cost if left > 0 else 0.0
    one = unit_cost(info)
    if allowed < one:
        cache = (f" (the prompt cache may hold {config.prompt_cache_bytes / 1e6:.1f} MB of it, "
                 "--prompt-cache-bytes)" if rt.prompt_cache is not None else "")
        raise ConfigError(f"the memory budget of {budget / 1e6:.1f} MB does not hold one image "
                          f"at the native size: the model holds {m.held / 1e6:.1f} MB{cache}, a "
                          f"call {m.fixed / 1e6:.1f} MB more, and an image "
                          f"{m.per_cost * one / 1e6:.1f} MB; raise the budget, or offload "
                          "(--offload)")
    batch, running = min(info.max_batch_cost, allowed), min(info.max_running_cost, allowed)
    rt.info = dataclasses.replace(info, max_batch_cost=batch, max_running_cost=running,
                                  memory_budget_bytes=budget, memory_cost_bound=allowed,
                                  memory_held_bytes=m.held + m.fixed,
                                  memory_per_cost_bytes=m.per_cost)
    binds = [name for name, mine, theirs in (("--max-batch-cost", allowed, info.max_batch_cost),
                                              ("--max-running-cost", allowed, info.max_running_cost))
             if mine < theirs]
    log.info("memory budget %.1f MB: the model holds %.1f MB, a call %.1f MB, a unit of cost %.2f "
             "MB; at most %.1f cost units: %s", budget / 1e6, m.held / 1e6, m.fixed / 1e6,
             m.per_cost / 1e6, allowed, f"it binds ({', '.join(binds)} lowered)" if binds else
             "the cost bounds bind first")
