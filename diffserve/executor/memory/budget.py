"""Admission by measured memory (``--gpu-memory-utilization``, ``--device-memory-bytes``;
docs/memory.md): at start the executor measures what its model holds and what a request takes,
and turns the budget into a bound on cost, the unit the scheduler already admits by.

- **Held**: on CUDA, what the allocator holds once the model is loaded and warmed up (weights,
  offload buffers, compiled graphs); on a CPU, the bytes of every weight and buffer.
- **Per cost**: one generation of one image at the native size and the model's default guidance,
  then of two (one step each, the prompt encoding and the decode included), through the plain
  pipeline: the growth from one image to two, per unit of cost (:mod:`diffserve.costs`), and the
  rest as a fixed part. On CUDA the allocator's peak; on a CPU an estimate: the bytes of every
  module's outputs in the call (an upper bound: freed tensors count too). With a step cache,
  each row's cached residual (the first block's output) is added to the per-cost bytes. Other
  sizes are priced by their cost, which is proportional to their latent pixels.
- **The bound**: ``(budget - held - fixed) / per cost``. It caps ``--max-batch-cost`` (one
  forward) and ``--max-running-cost`` (every set an executor holds) where it is the smaller; the
  executor decides it at start, and the scheduler's placement admits by it as by the configured
  bounds. A request that costs more than it is refused 400 ``exceeds_memory_budget``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from diffserve.config import ConfigError
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
    import torch

    budgets = []
    if config.device_memory_bytes:
        budgets.append(config.device_memory_bytes)
    if config.gpu_memory_utilization:
        if torch.device(device).type != "cuda":
            raise ConfigError(f"--gpu-memory-utilization is a share of a GPU's memory; this "
                              f"executor runs on {device}: use --device-memory-bytes")
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
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
    import torch

    from diffserve.executor.model.device_stats import DeviceStats
    from diffserve.work import ImageRequest, Work, WorkItem

    info, pipe = rt.info, rt.loaded.pipe
    modules = [*torch_modules(pipe).values(),  # and the control models beside them
               *(m.module for m in (rt.controls.models.values() if rt.controls else ()))]
    stats = DeviceStats(torch, rt.loaded.device)
    cuda = stats.cuda
    held = (torch.cuda.memory_allocated(stats.device) if cuda else
            sum(module_bytes(m)[1] for m in modules))
    runner, taken = rt.request_runner(), {}
    row = RowBytes(rt.family.denoisers[0]) if rt.step_cache is not None else None
    try:
        for images in (1, 2):
            request = ImageRequest(f"memory-{images}", info.name, info.width, info.height,
                                   num_inference_steps=1, guidance_scale=info.default_guidance_scale,
                                   prompt="a measure of memory", n=images, num_frames=info.num_frames)
            counter = None if cuda else OutputBytes(modules)
            base = stats.start()
            try:
                runner.execute(Work(0, [WorkItem(request, 0, images)]), [[]])
            finally:
                if counter is not None:
                    counter.close()
            taken[images] = stats.peak(base) if cuda else counter.total
    finally:
        if row is not None:
            row.close()
    unit = unit_cost(info)
    per_cost = max(taken[2] - taken[1], 1) / unit
    fixed = max(taken[1] - int(per_cost * unit), 0)
    if row is not None:  # what the step cache keeps per row (a row's cost is 1 at the native size)
        per_cost += row.bytes
    return Measured(held, fixed, per_cost)


def unit_cost(info) -> float:
    """The cost of one image at the native size and the model's default guidance."""
    from diffserve.costs import image_cost, uses_cfg

    return image_cost(1, 1, 1, 1, uses_cfg(info.guidance_rule, info.default_guidance_scale, ""))


class RowBytes:
    """The bytes of one row of the denoiser's first block output (what the step cache keeps per
    row), read by a forward hook on that block during the measuring calls."""

    def __init__(self, denoiser) -> None:
        import torch

        self.bytes, self.handle = 0, None
        lists = [m for m in denoiser.children() if isinstance(m, torch.nn.ModuleList)]
        if lists and len(lists[0]):
            self.handle = lists[0][0].register_forward_hook(self._read)

    def _read(self, module, args, output) -> None:
        import torch

        out = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(out, torch.Tensor) and not self.bytes:
            self.bytes = out.numel() * out.element_size() // max(out.shape[0], 1)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()


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
        raise ConfigError(f"the memory budget of {budget / 1e6:.1f} MB does not hold one image "
                          f"at the native size: the model holds {m.held / 1e6:.1f} MB, a call "
                          f"{m.fixed / 1e6:.1f} MB more, and an image {m.per_cost * one / 1e6:.1f} "
                          "MB; raise the budget, or offload (--offload)")
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
