"""HunyuanVideo 1.5's released architecture (480p text-to-video) for ``random:hunyuan-video-1.5``
(and ``random:hunyuan-video-1.5:tiny``): its modules at the published size (diffusers' defaults
for the DiT and the VAE are its own) and what the tiny scale changes (tiny-hunyuan-video15's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffserve.builders.random.parts import FULL, Architecture, Module
from diffserve.executor.families.hunyuan_video15.tiny import FRAMES


def _others(scale: str, scratch: Path) -> dict[str, Any]:
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler

    from diffserve.executor.families.hunyuan_video15.tiny import tokenizers

    return {**tokenizers(), "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
            "guider": ClassifierFreeGuidance(guidance_scale=6.0)}


def _qwen(scale: str, others: dict[str, Any]) -> dict[str, Any]:
    """Qwen2.5-VL-7B's text model, over the tokenizer's ids at the tiny scale."""
    rope = {"rope_type": "default", "rope_theta": 1e6}
    ids = others["tokenizer"].convert_tokens_to_ids
    if scale == FULL:
        return dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                    rms_norm_eps=1e-6, rope_parameters={**rope, "mrope_section": [16, 24, 24]})
    return dict(vocab_size=len(others["tokenizer"]), hidden_size=16, intermediate_size=16,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
                rope_parameters={**rope, "mrope_section": [1, 1, 2]})


HUNYUAN_VIDEO_15 = Architecture(
    "HunyuanVideo15Pipeline", "HunyuanVideo 1.5 text-to-video: an 8.3B 3D DiT (54 blocks), "
    "Qwen2.5-VL-7B and ByT5 (glyph) text encoders, its 16x spatial video VAE",
    {"transformer": Module("diffusers", "HunyuanVideo15Transformer3DModel", {}, dict(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=16, text_embed_2_dim=32,
        image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=32, task_type="t2v")),
     "vae": Module("diffusers", "AutoencoderKLHunyuanVideo15", {}, dict(
         latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
         spatial_compression_ratio=8, temporal_compression_ratio=2,
         downsample_match_channel=False, upsample_match_channel=False)),
     "text_encoder": Module("transformers", "Qwen2_5_VLTextModel", {},
                            config_class="Qwen2_5_VLTextConfig", derived=_qwen),
     # ByT5-small's encoder, over its byte ids.
     "text_encoder_2": Module("transformers", "T5EncoderModel", dict(
         vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
         feed_forward_proj="gated-gelu", tie_word_embeddings=False), dict(
         d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
         relative_attention_num_buckets=8, feed_forward_proj="relu"), config_class="T5Config")},
    _others,
    lambda scale: {"width": 848 if scale == FULL else 32, "height": 480 if scale == FULL else 32,
                   "spatial_stride": 16, "guidance_scale": 6.0,
                   "num_inference_steps": 50 if scale == FULL else 4,
                   "num_frames": 121 if scale == FULL else FRAMES, "fps": 24})


ARCHITECTURES = {"hunyuan-video-1.5": HUNYUAN_VIDEO_15}
