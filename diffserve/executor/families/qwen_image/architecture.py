"""Qwen-Image's released architecture for ``random:qwen-image`` (and ``random:qwen-image:tiny``):
its modules at the published size and what the tiny scale changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffserve.builders.random.parts import FULL, Architecture, Module, size


def _qwen_tokenizer():
    from diffusers import QwenImagePipeline

    from diffserve.builders.tokenizers import qwen2_tokenizer

    return qwen2_tokenizer([QwenImagePipeline(None, None, None, None, None).prompt_template_encode])


def _qwen_others(scale: str, scratch: Path) -> dict[str, Any]:
    from diffserve.executor.families.qwen_image.tiny import scheduler

    return {"tokenizer": _qwen_tokenizer(), "scheduler": scheduler()}  # Qwen-Image's settings


def _qwen_vl(scale: str, others: dict[str, Any]) -> dict[str, Any]:
    """Qwen2.5-VL-7B (its text model, and a vision tower only because the class has one), over
    the tokenizer's special ids."""
    ids = others["tokenizer"].convert_tokens_to_ids
    special = dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                   vision_start_token_id=ids("<|vision_start|>"),
                   vision_end_token_id=ids("<|vision_end|>"))
    text = dict(bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"))
    if scale == FULL:
        return dict(**special, text_config=dict(**text, vocab_size=152064,
            hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24],
                             "rope_theta": 1e6}),
            vision_config=dict(hidden_size=1280))  # else transformers' defaults, 7B's
    return dict(**special, text_config=dict(
        **text, vocab_size=len(others["tokenizer"]), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                "rope_theta": 1e6}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=32, fullatt_block_indexes=[0]))


QWEN_IMAGE = Architecture(
    "QwenImagePipeline", "Qwen-Image: a 20B MM-DiT (60 blocks), a Qwen2.5-VL-7B text encoder, "
    "a video-style VAE; true classifier-free guidance",
    {"transformer": Module("diffusers", "QwenImageTransformer2DModel", {},
                           dict(num_layers=2, attention_head_dim=16, num_attention_heads=2,
                                joint_attention_dim=32, axes_dims_rope=(4, 6, 6))),
     "vae": Module("diffusers", "AutoencoderKLQwenImage", {},
                   dict(base_dim=8, dim_mult=[1, 2, 4, 4], num_res_blocks=1)),
     "text_encoder": Module("transformers", "Qwen2_5_VLForConditionalGeneration", {},
                            config_class="Qwen2_5_VLConfig", derived=_qwen_vl)},
    _qwen_others,
    lambda scale: {**size(scale, 1024), "spatial_stride": 16, "guidance_scale": 4.0,
                   "num_inference_steps": 50 if scale == FULL else 4})


ARCHITECTURES = {"qwen-image": QWEN_IMAGE}
