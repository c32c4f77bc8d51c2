"""Wan (video diffusion: a 3D DiT over a causal video VAE's latents, flow matching, UMT5):
tiny-wan (2.1 text-to-video), tiny-wan22 (2.2: a high-noise and a low-noise expert) and
tiny-wan-i2v (image-to-video, conditioned on a CLIP vision encoding of the first frame)."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.tokenizers import character_t5_tokenizer

TEXT_DIM = 32
FRAMES = 9  # native frame count: 4k+1, three latent frames


def _transformer(seed: int, in_channels: int = 16, **extra):
    from diffusers import WanTransformer3DModel

    return seeded(seed, WanTransformer3DModel, patch_size=(1, 2, 2), num_attention_heads=2,
                  attention_head_dim=12, in_channels=in_channels, out_channels=16, text_dim=TEXT_DIM,
                  freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **extra)


def _parts() -> dict:
    """The components every tiny Wan shares: the video VAE (8x spatial, 4x temporal), UMT5 and
    its tokenizer, and Wan's own sampler (UniPC over flow sigmas, shifted)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = character_t5_tokenizer()
    encoder = seeded(0, UMT5EncoderModel, UMT5Config(
        vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0))
    vae = seeded(0, AutoencoderKLWan, base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                 num_res_blocks=1, temperal_downsample=[False, True, True])
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=3.0)
    return dict(tokenizer=tokenizer, text_encoder=encoder, vae=vae, scheduler=scheduler)


def _save(pipe, directory: Path) -> None:
    # Wan pads prompts to 512 tokens by default: far more text than video tokens here.
    save(pipe, directory, spatial_stride=16, guidance_scale=5.0, size=32,
         pipeline_kwargs={"max_sequence_length": 32}, num_frames=FRAMES, fps=8)


def build(directory: Path) -> None:
    """WanPipeline (2.1): a two-block 3D DiT, 32x32 native, 9 frames, 4 steps."""
    from diffusers import WanPipeline

    _save(WanPipeline(transformer=_transformer(0), **_parts()), directory)


def build_22(directory: Path) -> None:
    """WanPipeline (2.2 A14B layout): ``transformer`` denoises while the timestep is at or above
    ``boundary_ratio`` x 1000, ``transformer_2`` below it."""
    from diffusers import WanPipeline

    _save(WanPipeline(transformer=_transformer(0), transformer_2=_transformer(1),
                      boundary_ratio=0.875, **_parts()), directory)


def build_i2v(directory: Path) -> None:
    """WanImageToVideoPipeline (2.1): the first frame's CLIP vision features and its VAE latents
    (with a mask of the known frame) condition every step."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    encoder = seeded(0, CLIPVisionModel, CLIPVisionConfig(
        hidden_size=8, projection_dim=8, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, intermediate_size=16, patch_size=8))
    processor = CLIPImageProcessor(crop_size=32, size=32)
    pipe = WanImageToVideoPipeline(transformer=_transformer(0, image_dim=8, in_channels=36),
                                   image_encoder=encoder, image_processor=processor, **_parts())
    _save(pipe, directory)


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-wan": ("Wan 2.1 text-to-video (3D DiT, video VAE, UMT5) with random weights, 32x32, "
                 "9 frames, 4 steps", build),
    "tiny-wan22": ("Wan 2.2 text-to-video (two experts switched at boundary_ratio 0.875) with "
                   "random weights, 32x32, 9 frames, 4 steps", build_22),
    "tiny-wan-i2v": ("Wan 2.1 image-to-video (the first frame through CLIP vision and the VAE) "
                     "with random weights, 32x32, 9 frames, 4 steps", build_i2v),
}
