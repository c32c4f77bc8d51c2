"""Workarounds for library versions the server runs with, each for a stated case.

- **Qwen2-VL processors without torchvision.** transformers 5.x builds a Qwen2VLProcessor from
  an image processor, a tokenizer and a *video* processor, and every video processor needs
  torchvision; a CPU-only install without it cannot load any Qwen-Image-Edit pipeline (tiny or
  real), though image edits never pass a video. Where torchvision is missing, the processor is
  built from its image processor and tokenizer alone.
- **diffusers' parallelism on a CPU host** (:func:`one_device_per_cpu_rank`).
- **A rank's own device in diffusers' parallelism** (:func:`on_rank_device`).
"""

from __future__ import annotations

from contextlib import contextmanager


def allow_processors_without_torchvision() -> bool:
    """Applies the Qwen2-VL case above where torchvision is missing; whether it did."""
    from transformers import Qwen2VLProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available() or getattr(Qwen2VLProcessor, "_images_only", False):
        return False
    Qwen2VLProcessor.get_attributes = classmethod(lambda cls: ["image_processor", "tokenizer"])
    Qwen2VLProcessor._images_only = True
    return True


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
