"""Workarounds for library versions that building a pipeline and loading one both need.

- **Qwen2-VL processors without torchvision.** transformers 5.x builds a Qwen2VLProcessor from
  an image processor, a tokenizer and a *video* processor, and every video processor needs
  torchvision; a CPU-only install without it cannot load any Qwen-Image-Edit pipeline (tiny or
  real), though image edits never pass a video. Where torchvision is missing, the processor is
  built from its image processor and tokenizer alone.
"""

from __future__ import annotations


def allow_processors_without_torchvision() -> bool:
    """Applies the Qwen2-VL case above where torchvision is missing; whether it did."""
    from transformers import Qwen2VLProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available() or getattr(Qwen2VLProcessor, "_images_only", False):
        return False
    Qwen2VLProcessor.get_attributes = classmethod(lambda cls: ["image_processor", "tokenizer"])
    Qwen2VLProcessor._images_only = True
    return True
