"""Z-Image-Turbo's released architecture for ``random:z-image-turbo`` (and ``random:z-image-turbo:tiny``):
its modules at the published size and what the tiny scale changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffserve.builders.random.parts import FULL, TINY, Architecture, Module, flux_vae, size


def _z_image_tokenizer():
    from diffserve.builders.tokenizers import qwen2_tokenizer
    from diffserve.executor.families.z_image.tiny import CHAT_TEMPLATE

    tokenizer = qwen2_tokenizer(["<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _z_image_others(scale: str, scratch: Path) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return {"tokenizer": _z_image_tokenizer(),
            "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False)}


Z_IMAGE_TURBO = Architecture(
    "ZImagePipeline", "Z-Image-Turbo: a 6B single-stream DiT (30 layers), a Qwen3-4B text "
    "encoder, FLUX.1's VAE; distilled to 8 steps without guidance",
    {"transformer": Module("diffusers", "ZImageTransformer2DModel", {},
                           dict(dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[1024, 512, 512])),
     "vae": flux_vae(),
     "text_encoder": Module("transformers", "Qwen3Model",
                            dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                                 num_hidden_layers=36, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                                 rms_norm_eps=1e-6, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                            dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                 max_position_embeddings=4096),
                            config_class="Qwen3Config",
                            derived=lambda scale, others: {
                                "pad_token_id": others["tokenizer"].pad_token_id,
                                "eos_token_id": others["tokenizer"].eos_token_id,
                                **({"vocab_size": len(others["tokenizer"])}
                                   if scale == TINY else {})})},
    _z_image_others,
    lambda scale: {**size(scale, 1024), "spatial_stride": 16, "guidance_scale": 0.0,
                   "num_inference_steps": 8 if scale == FULL else 4})


ARCHITECTURES = {"z-image-turbo": Z_IMAGE_TURBO}
