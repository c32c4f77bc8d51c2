"""Workarounds for library versions the server runs with, each for a stated case (the one that
building a tiny model needs too, Qwen2-VL processors without torchvision, is in
:mod:`diffserve.builders.compat`).

- **diffusers' parallelism on a CPU host** (:func:`one_device_per_cpu_rank`).
- **A rank's own device in diffusers' parallelism** (:func:`on_rank_device`).
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def one_device_per_cpu_rank():
    """**diffusers' parallelism on a CPU host.** diffusers picks a rank's device as ``rank %
    torch.accelerator.device_count()``, a division by zero where no accelerator is counted.
    Inside the block, a CPU-only process counts one device (the CPU)."""
    import torch

    if torch.accelerator.device_count():
        yield
        return
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count


@contextmanager
def on_rank_device(device):
    """**A rank's own device in diffusers' parallelism.** diffusers gives a rank's parallel config
    the device ``rank % visible devices``: right only where every rank sees its own GPU alone. A
    group's ranks keep the operator's visible set (``CUDA_VISIBLE_DEVICES=4,5,6,7`` on a shared
    node) and each makes its own GPU current, so inside the block the parallel config diffusers
    resolves (the tensor-parallel shards load onto its device) names ``device`` instead."""
    import torch
    from diffusers.models.modeling_utils import ModelMixin

    original = ModelMixin._resolve_parallel_config

    def resolve(self, config):
        resolved = original(self, config)
        for part in (resolved, resolved.context_parallel_config, resolved.tensor_parallel_config):
            if part is not None:
                part._device = torch.device(device)
        return resolved

    ModelMixin._resolve_parallel_config = resolve
    try:
        yield
    finally:
        ModelMixin._resolve_parallel_config = original
