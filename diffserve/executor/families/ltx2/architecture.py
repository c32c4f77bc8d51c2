"""LTX-2's released architecture for ``random:ltx-2`` (and ``random:ltx-2:tiny``): its modules at
the published size (diffusers' defaults for its classes are LTX-2's) and what the tiny scale
changes (tiny-ltx2's sizes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffserve.builders.random.parts import FULL, Architecture, Module
from diffserve.executor.families.ltx2.tiny import (
    FPS,
    PIPELINE_KWARGS,
    TEXT_DIM,
    TEXT_LAYERS,
)


def _others(scale: str, scratch: Path) -> dict[str, Any]:
    from diffserve.executor.families.ltx2.tiny import scheduler, tokenizer

    return {"tokenizer": tokenizer(), "scheduler": scheduler()}


def _gemma3(scale: str, others: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 12B (its vision tower only because the class has one), over the tokenizer's ids."""
    tokenizer = others["tokenizer"]
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=tokenizer.bos_token_id)
    if scale == FULL:
        return dict(text_config=dict(
            **ids, vocab_size=262208, hidden_size=3840, intermediate_size=15360,
            num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
            query_pre_attn_scalar=256, sliding_window=1024),
            vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                               num_attention_heads=16, image_size=896, patch_size=14),
            mm_tokens_per_image=256)
    return dict(text_config=dict(
        **ids, vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=32,
        num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        query_pre_attn_scalar=8, sliding_window=16),
        vision_config=dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=8),
        mm_tokens_per_image=4, boi_token_index=0, eoi_token_index=0, image_token_index=0)


LTX_2 = Architecture(
    "LTX2Pipeline", "LTX-2: an audio-video DiT (48 blocks, 19B) making a video and its sound, "
    "Gemma 3 12B through text connectors, the LTX-2 video VAE, an audio VAE and a vocoder",
    {"transformer": Module("diffusers", "LTX2VideoTransformer3DModel", {}, dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
        num_layers=2, caption_channels=TEXT_DIM, rope_double_precision=False, rope_type="split",
        vae_scale_factors=(2, 16, 16))),
     "connectors": Module("ltx2", "LTX2TextConnectors", {}, dict(
         caption_channels=TEXT_DIM, text_proj_in_factor=TEXT_LAYERS + 1,
         video_connector_num_attention_heads=2, video_connector_attention_head_dim=8,
         video_connector_num_layers=1, video_connector_num_learnable_registers=None,
         audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8,
         audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
         connector_rope_base_seq_len=32, rope_double_precision=False, rope_type="split")),
     "vae": Module("diffusers", "AutoencoderKLLTX2Video", {}, dict(
         latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
         layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
         decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False),
         downsample_type=("spatial",), upsample_residual=(False,), upsample_factor=(1,),
         patch_size=8, decoder_causal=False)),
     "audio_vae": Module("diffusers", "AutoencoderKLLTX2Audio", {}, dict(
         base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, latent_channels=2,
         resolution=32, mid_block_add_attention=False, mel_bins=8)),
     "vocoder": Module("ltx2", "LTX2Vocoder", {}, dict(
         in_channels=16, hidden_channels=32, upsample_kernel_sizes=[10, 8, 8],
         upsample_factors=[5, 4, 4], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
         output_sampling_rate=8000)),
     "text_encoder": Module("transformers", "Gemma3ForConditionalGeneration", {},
                            config_class="Gemma3Config", derived=_gemma3)},
    _others,
    lambda scale: {"width": 768 if scale == FULL else 32, "height": 512 if scale == FULL else 32,
                   "spatial_stride": 32, "guidance_scale": 4.0,
                   "num_inference_steps": 40 if scale == FULL else 4,
                   "num_frames": 121 if scale == FULL else 9, "fps": FPS,
                   "pipeline_kwargs": {**PIPELINE_KWARGS, "max_sequence_length":
                                       1024 if scale == FULL else 16}})


ARCHITECTURES = {"ltx-2": LTX_2}
