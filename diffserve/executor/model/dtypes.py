"""Which dtype an executor's model runs in: resolved once, before the model loads (its device
is chosen first, by :mod:`diffserve.device.choice`).

``auto`` is float32 on the CPU. On a GPU it is the dtype the model's family is published in:
bfloat16 for the families trained in it (Flux, FLUX.2, Chroma, Qwen-Image, Z-Image, Wan, Sana, SD3
and the rest), float16 only for the families published in float16 (SD 1.x/2.x, SDXL), whose
weights overflow nowhere in it; float16 also where the GPU has no bfloat16 natively (before
Ampere: T4, V100; torch counts an emulated bfloat16 as supported, which is slow, so only native support counts here: the device layer's ``bf16_native``). A pipeline the
step engine does not know takes bfloat16: float16's narrow range is what turns activations into
inf and images into NaN.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

DEFAULT_HALF = "bfloat16"  # a GPU's dtype for a pipeline whose family says nothing


def resolve_dtype(requested: str, device: str, preferred: str | None,
                  bf16_supported: bool | None = None) -> str:
    """The weights' dtype: ``requested`` unless it is ``auto``; then float32 on the CPU, and on a
    GPU the family's ``preferred`` dtype (None: a pipeline the step engine does not know), with
    float16 where the GPU cannot compute in bfloat16."""
    if requested != "auto":
        return requested
    if not device.startswith("cuda"):
        return "float32"
    chosen = preferred or DEFAULT_HALF
    if chosen == "bfloat16":
        if bf16_supported is None:
            from diffserve.device import of

            bf16_supported = of(device).bf16_native(device)
        if not bf16_supported:
            return "float16"
    return chosen


def auto_dtype(requested: str, device: str, published: str | None) -> str:
    """:func:`resolve_dtype`, with ``auto``'s choice on a GPU logged (``published``: the dtype the
    model's family is published in, None for a pipeline the step engine does not know)."""
    dtype = resolve_dtype(requested, device, published)
    if requested == "auto" and device.startswith("cuda"):
        log.info("--dtype auto: %s on %s (%s)", dtype, device,
                 f"the family's published dtype, {published}" if published else
                 "the default for a pipeline the step engine does not know")
    return dtype
