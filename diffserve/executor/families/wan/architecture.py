"""Wan 2.1 14B (text to video)'s released architecture for ``random:wan2.1-14b`` (and ``random:wan2.1-14b:tiny``):
its modules at the published size and what the tiny scale changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffserve.builders.random.parts import FULL, Architecture, Module, t5


def _wan_others(scale: str, scratch: Path) -> dict[str, Any]:
    from diffusers import UniPCMultistepScheduler

    from diffserve.builders.tokenizers import character_t5_tokenizer

    return {"tokenizer": character_t5_tokenizer(),
            "scheduler": UniPCMultistepScheduler(prediction_type="flow_prediction",
                                                 use_flow_sigmas=True, flow_shift=5.0)}


WAN_2_1_14B = Architecture(
    "WanPipeline", "Wan 2.1 text-to-video 14B: a 3D DiT (40 layers), UMT5-XXL, the Wan video VAE",
    {"transformer": Module("diffusers", "WanTransformer3DModel", {},
                           dict(num_attention_heads=2, attention_head_dim=12, text_dim=32,
                                freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32)),
     "vae": Module("diffusers", "AutoencoderKLWan", {},
                   dict(base_dim=3, dim_mult=[1, 1, 1, 1], num_res_blocks=1)),
     "text_encoder": t5("UMT5EncoderModel", "UMT5Config", 256384, "tokenizer")},
    _wan_others,
    lambda scale: {"width": 832 if scale == FULL else 32, "height": 480 if scale == FULL else 32,
                   "spatial_stride": 16, "guidance_scale": 5.0,
                   "num_inference_steps": 50 if scale == FULL else 4,
                   "num_frames": 81 if scale == FULL else 9, "fps": 16,
                   "pipeline_kwargs": {"max_sequence_length": 512 if scale == FULL else 32}})


ARCHITECTURES = {"wan2.1-14b": WAN_2_1_14B}
