"""Where each component of the loaded pipeline sits, and what it takes: the shape ``/v1/models``
and the start-up log share (``components: [{name, device, rank, dtype, bytes}]``)."""

from __future__ import annotations

from diffserve.executor.pipeline import torch_modules
from diffserve.executor.tensors import module_bytes
from diffserve.wire.model_info import Component


def placements(pipe, group=None) -> list[Component]:
    """Each torch module of ``pipe`` (denoisers, text encoders, VAE, image encoders) on each rank
    of ``group`` (on this process only without one). Context parallelism replicates every
    component on every rank; tensor parallelism shards the denoiser (each rank holds its share,
    what ``bytes`` counts)."""
    found = []
    for name, module in torch_modules(pipe).items():
        tensors = [*module.parameters(), *module.buffers()]
        first = next((t for t in tensors if t.is_floating_point()), tensors[0] if tensors else None)
        device = str(first.device) if first is not None else "cpu"
        dtype = str(first.dtype).removeprefix("torch.") if first is not None else ""
        size = module_bytes(module)[1]
        ranks = range(group.degrees.size) if group is not None else [0]
        for rank in ranks:
            where = device if group is None or rank == group.rank else group.spec.devices[rank]
            found.append(Component(name, where, rank, dtype, size))
    return found
