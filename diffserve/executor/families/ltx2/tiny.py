"""LTX-2 (one DiT over a video's and its sound's latents, Gemma 3 text through connectors, a
video VAE, an audio VAE and a vocoder): tiny-ltx2."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.tokenizers import gemma_tokenizer

TEXT_DIM = 16
TEXT_LAYERS = 2
FRAMES = 9  # native frame count: 8k+1 would be the released model's; here 2k+1, five latent frames
FPS = 24
SAMPLE_RATE = 8000  # the vocoder's output: 80 samples a mel frame of 10 ms
# What the step engine runs as the pipeline does (docs/videos.md): classifier-free guidance on
# both modalities, no spatio-temporal or modality-isolation guidance, no guidance rescale.
PIPELINE_KWARGS = {"max_sequence_length": 16, "frame_rate": float(FPS), "stg_scale": 0.0,
                   "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0,
                   "guidance_rescale": 0.0, "audio_guidance_rescale": 0.0,
                   "audio_guidance_scale": None}


def text_encoder(tokenizer):
    """A two-layer Gemma 3 (its vision tower too, as the class holds one; never called)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=32,
                         num_hidden_layers=TEXT_LAYERS, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8,
                         sliding_window=16, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id),
        vision_config=dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=8),
        mm_tokens_per_image=4, boi_token_index=0, eoi_token_index=0, image_token_index=0)
    return seeded(0, Gemma3ForConditionalGeneration, config)


def components() -> dict:
    """Every module of a tiny LTX-2: 16x spatial and 2x temporal video compression, 4 latent
    channels; sound as 8 mel bins at 100 frames a second, 4x compressed, two channels out."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    words = tokenizer()
    transformer = seeded(
        0, LTX2VideoTransformer3DModel, in_channels=4, out_channels=4, patch_size=1,
        patch_size_t=1, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
        qk_norm="rms_norm_across_heads", caption_channels=TEXT_DIM, rope_double_precision=False,
        rope_type="split", vae_scale_factors=(2, 16, 16))
    connectors = seeded(
        0, LTX2TextConnectors, caption_channels=TEXT_DIM, text_proj_in_factor=TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=8,
        video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32, rope_double_precision=False, rope_type="split")
    vae = seeded(
        0, AutoencoderKLLTX2Video, latent_channels=4, block_out_channels=(8,),
        decoder_block_out_channels=(8,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False,
        patch_size=8, patch_size_t=1, encoder_causal=True, decoder_causal=False)
    audio_vae = seeded(
        0, AutoencoderKLLTX2Audio, base_channels=4, output_channels=2, ch_mult=(1,),
        num_res_blocks=1, attn_resolutions=None, in_channels=2, resolution=32, latent_channels=2,
        norm_type="pixel", causality_axis="height", dropout=0.0, mid_block_add_attention=False,
        sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    vocoder = seeded(
        0, LTX2Vocoder, in_channels=2 * 8, hidden_channels=32, out_channels=2,
        upsample_kernel_sizes=[10, 8, 8], upsample_factors=[5, 4, 4], resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]], output_sampling_rate=SAMPLE_RATE)
    return dict(tokenizer=words, text_encoder=text_encoder(words), connectors=connectors,
                transformer=transformer, vae=vae, audio_vae=audio_vae, vocoder=vocoder,
                scheduler=scheduler())


def tokenizer():
    return gemma_tokenizer(["a start-up check of the step engine"])


def scheduler():
    """LTX-2's sampler: Euler over flow sigmas, shifted by the video's token count."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1)


def build(directory: Path) -> None:
    """LTX2Pipeline: a two-block audio-video DiT, 32x32 native, 9 frames at 24 fps, 4 steps."""
    from diffusers import LTX2Pipeline

    save(LTX2Pipeline(**components()), directory, spatial_stride=32, guidance_scale=4.0, size=32,
         pipeline_kwargs=PIPELINE_KWARGS, num_frames=FRAMES, fps=FPS)


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-ltx2": ("LTX-2 text-to-video with sound (audio-video DiT, video VAE, audio VAE, "
                  "vocoder, Gemma 3) with random weights, 32x32, 9 frames, 4 steps", build),
}
