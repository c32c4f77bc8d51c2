"""Workarounds for library versions the server runs with, each for a stated case.

- **Qwen2-VL processors without torchvision.** transformers 5.x builds a Qwen2VLProcessor from
  an image processor, a tokenizer and a *video* processor, and every video processor needs
  torchvision; a CPU-only install without it cannot load any Qwen-Image-Edit pipeline (tiny or
  real), though image edits never pass a video. Where torchvision is missing, the processor is
  built from its image processor and tokenizer alone.
- **diffusers' parallelism on a CPU host** (:func:`one_device_per_cpu_rank`).
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
    Inside the block, a CPU-only process counts one device (the CPU), as a GPU rank whose
    ``CUDA_VISIBLE_DEVICES`` names its one GPU counts one."""
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
