"""FLUX.1 [dev]'s released architecture for ``random:flux.1-dev`` (and ``random:flux.1-dev:tiny``):
its modules at the published size and what the tiny scale changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffserve.builders.random.parts import FULL, Architecture, Module, clip, flux_vae, size, t5


def _flux_others(scale: str, scratch: Path) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffserve.builders.tokenizers import character_t5_tokenizer, write_byte_clip_tokenizer

    return {"tokenizer": write_byte_clip_tokenizer(scratch / "clip"),
            "tokenizer_2": character_t5_tokenizer(),
            "scheduler": FlowMatchEulerDiscreteScheduler(max_image_seq_len=4096, max_shift=1.15,
                                                         shift=3.0, use_dynamic_shifting=True)}


FLUX_1_DEV = Architecture(
    "FluxPipeline", "FLUX.1 [dev]: a 12B MM-DiT (19 double and 38 single blocks), CLIP-L and "
    "T5-XXL, guidance as an embedding",
    {"transformer": Module("diffusers", "FluxTransformer2DModel", dict(guidance_embeds=True),
                           dict(num_layers=1, num_single_layers=2, attention_head_dim=16,
                                num_attention_heads=2, joint_attention_dim=32,
                                pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))),
     "vae": flux_vae(),
     "text_encoder": clip(768, 12, 12, 3072, "quick_gelu"),
     "text_encoder_2": t5("T5EncoderModel", "T5Config", 32128, "tokenizer_2")},
    _flux_others,
    lambda scale: {**size(scale, 1024), "spatial_stride": 16, "guidance_scale": 3.5,
                   "num_inference_steps": 28 if scale == FULL else 4,
                   "pipeline_kwargs": {"max_sequence_length": 512 if scale == FULL else 64}})


ARCHITECTURES = {"flux.1-dev": FLUX_1_DEV}
