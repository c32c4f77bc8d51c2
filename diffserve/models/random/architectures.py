"""Released models' architectures, as configs: each module's class and its published size, and
what scales it down to run on a CPU (``:tiny``: the same structure with fewer and narrower
layers). Where diffusers' defaults are the released model's sizes (the FLUX.1, Qwen-Image, Z-Image
and Wan transformers, the Qwen-Image and Wan VAEs), those. Tokenizers are built in memory
(:mod:`diffserve.models.tokenizers`): their ids are all a random model needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

FULL, TINY = "full", "tiny"
SCALES = (FULL, TINY)


@dataclass(frozen=True)
class Module:
    """A torch module of the pipeline: its library, class, and config (``config`` at the
    published size, ``tiny`` what the tiny scale changes; ``derived(scale, others)`` what
    follows from the other components, a tokenizer's ids); ``config_class`` for a transformers
    model (its config object's class)."""

    library: str
    cls: str
    config: dict[str, Any]
    tiny: dict[str, Any] = field(default_factory=dict)
    config_class: str | None = None
    derived: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None

    def config_at(self, scale: str, others: dict[str, Any]) -> dict[str, Any]:
        config = {**self.config, **(self.tiny if scale == TINY else {})}
        return {**config, **(self.derived(scale, others) if self.derived else {})}


@dataclass(frozen=True)
class Architecture:
    pipeline: str
    description: str
    modules: dict[str, Module]
    # (scale, scratch directory) -> the other components (tokenizers, scheduler)
    others: Callable[[str, Path], dict[str, Any]]
    # scale -> serving defaults (diffserve.json)
    defaults: Callable[[str], dict[str, Any]]
    pipeline_config: dict[str, Any] = field(default_factory=dict)  # the index's extra settings


def _clip(width: int, layers: int, heads: int, inner: int, act: str, tiny_width: int = 32,
          projection: bool = False) -> Module:
    """A CLIP text encoder over the byte CLIP tokenizer's ids (514 of them at the tiny scale)."""
    return Module("transformers", "CLIPTextModelWithProjection" if projection else "CLIPTextModel",
                  dict(vocab_size=49408, hidden_size=width, intermediate_size=inner,
                       num_hidden_layers=layers, num_attention_heads=heads, projection_dim=width,
                       hidden_act=act, bos_token_id=512, eos_token_id=513, pad_token_id=513,
                       max_position_embeddings=77),
                  dict(vocab_size=514, hidden_size=tiny_width, intermediate_size=2 * tiny_width,
                       num_hidden_layers=2, num_attention_heads=4, projection_dim=tiny_width),
                  config_class="CLIPTextConfig")


def _t5(cls: str, config_class: str, vocab: int, tokenizer: str) -> Module:
    """T5-XXL's encoder (FLUX.1) or UMT5-XXL's (Wan); at the tiny scale over the character
    tokenizer's ids alone."""
    return Module("transformers", cls,
                  dict(vocab_size=vocab, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                       num_heads=64, feed_forward_proj="gated-gelu", decoder_start_token_id=0,
                       relative_attention_max_distance=128, tie_word_embeddings=False),
                  dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                       relative_attention_num_buckets=8, feed_forward_proj="relu"),
                  config_class=config_class,
                  derived=lambda scale, others: ({"vocab_size": len(others[tokenizer])}
                                                 if scale == TINY else {}))


def _flux_vae(scaling: float = 0.3611, shift: float = 0.1159) -> Module:
    return Module("diffusers", "AutoencoderKL",
                  dict(latent_channels=16, block_out_channels=(128, 256, 512, 512),
                       layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
                       up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=scaling,
                       shift_factor=shift, use_quant_conv=False, use_post_quant_conv=False),
                  dict(block_out_channels=(16, 16, 32, 32), layers_per_block=1, norm_num_groups=8))


def _size(scale: str, full: int, tiny: int = 64) -> dict[str, int]:
    side = full if scale == FULL else tiny
    return {"width": side, "height": side}


# -- FLUX.1-dev ------------------------------------------------------------------------------


def _flux_others(scale: str, scratch: Path) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffserve.models.tokenizers import character_t5_tokenizer, write_byte_clip_tokenizer

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
     "vae": _flux_vae(),
     "text_encoder": _clip(768, 12, 12, 3072, "quick_gelu"),
     "text_encoder_2": _t5("T5EncoderModel", "T5Config", 32128, "tokenizer_2")},
    _flux_others,
    lambda scale: {**_size(scale, 1024), "spatial_stride": 16, "guidance_scale": 3.5,
                   "num_inference_steps": 28 if scale == FULL else 4,
                   "pipeline_kwargs": {"max_sequence_length": 512 if scale == FULL else 64}})


# -- Qwen-Image ------------------------------------------------------------------------------


def _qwen_tokenizer():
    from diffusers import QwenImagePipeline

    from diffserve.models.tokenizers import qwen2_tokenizer

    return qwen2_tokenizer([QwenImagePipeline(None, None, None, None, None).prompt_template_encode])


def _qwen_others(scale: str, scratch: Path) -> dict[str, Any]:
    from diffserve.models.tiny.qwen_image import scheduler

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
    lambda scale: {**_size(scale, 1024), "spatial_stride": 16, "guidance_scale": 4.0,
                   "num_inference_steps": 50 if scale == FULL else 4})


# -- Z-Image-Turbo ---------------------------------------------------------------------------


def _z_image_tokenizer():
    from diffserve.models.tiny.z_image import CHAT_TEMPLATE
    from diffserve.models.tokenizers import qwen2_tokenizer

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
     "vae": _flux_vae(),
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
    lambda scale: {**_size(scale, 1024), "spatial_stride": 16, "guidance_scale": 0.0,
                   "num_inference_steps": 8 if scale == FULL else 4})


# -- Wan 2.1 14B (text to video) ---------------------------------------------------------------


def _wan_others(scale: str, scratch: Path) -> dict[str, Any]:
    from diffusers import UniPCMultistepScheduler

    from diffserve.models.tokenizers import character_t5_tokenizer

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
     "text_encoder": _t5("UMT5EncoderModel", "UMT5Config", 256384, "tokenizer")},
    _wan_others,
    lambda scale: {"width": 832 if scale == FULL else 32, "height": 480 if scale == FULL else 32,
                   "spatial_stride": 16, "guidance_scale": 5.0,
                   "num_inference_steps": 50 if scale == FULL else 4,
                   "num_frames": 81 if scale == FULL else 9, "fps": 16,
                   "pipeline_kwargs": {"max_sequence_length": 512 if scale == FULL else 32}})


# -- SDXL ------------------------------------------------------------------------------------


def _sdxl_others(scale: str, scratch: Path) -> dict[str, Any]:
    from diffusers import EulerDiscreteScheduler

    from diffserve.models.tokenizers import write_byte_clip_tokenizer

    clip = write_byte_clip_tokenizer(scratch / "clip")
    return {"tokenizer": clip, "tokenizer_2": clip,
            "scheduler": EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012,
                                                beta_schedule="scaled_linear", steps_offset=1,
                                                timestep_spacing="leading")}


SDXL = Architecture(
    "StableDiffusionXLPipeline", "Stable Diffusion XL base: a 2.6B UNet, CLIP-L and "
    "OpenCLIP-bigG, its VAE",
    {"unet": Module("diffusers", "UNet2DConditionModel",
                    dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
                         block_out_channels=(320, 640, 1280),
                         down_block_types=("DownBlock2D", "CrossAttnDownBlock2D",
                                           "CrossAttnDownBlock2D"),
                         up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                         transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
                         cross_attention_dim=2048, use_linear_projection=True,
                         addition_embed_type="text_time", addition_time_embed_dim=256,
                         projection_class_embeddings_input_dim=2816),
                    dict(sample_size=8, layers_per_block=1, block_out_channels=(32, 64),
                         down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                         up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                         transformer_layers_per_block=(1, 2), attention_head_dim=8,
                         cross_attention_dim=96, addition_time_embed_dim=8,
                         projection_class_embeddings_input_dim=6 * 8 + 64, norm_num_groups=8)),
     "vae": Module("diffusers", "AutoencoderKL",
                   dict(latent_channels=4, block_out_channels=(128, 256, 512, 512),
                        layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=0.13025,
                        sample_size=1024, force_upcast=True),
                   dict(block_out_channels=(16, 16, 32, 32), layers_per_block=1,
                        norm_num_groups=8, sample_size=64, force_upcast=False)),
     "text_encoder": _clip(768, 12, 12, 3072, "quick_gelu"),
     "text_encoder_2": _clip(1280, 32, 20, 5120, "gelu", tiny_width=64, projection=True)},
    _sdxl_others,
    lambda scale: {**_size(scale, 1024), "spatial_stride": 8, "guidance_scale": 5.0,
                   "num_inference_steps": 30 if scale == FULL else 4},
    pipeline_config={"force_zeros_for_empty_prompt": True})


ARCHITECTURES: dict[str, Architecture] = {
    "flux.1-dev": FLUX_1_DEV,
    "qwen-image": QWEN_IMAGE,
    "z-image-turbo": Z_IMAGE_TURBO,
    "wan2.1-14b": WAN_2_1_14B,
    "sdxl": SDXL,
}
