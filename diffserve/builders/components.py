"""Text encoders and VAEs that the tiny families build from, each from a fixed seed."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import SCRATCH, seeded
from diffserve.builders.tokenizers import write_byte_clip_tokenizer


def clip_tokenizer(directory: Path):
    """The byte CLIP tokenizer, written under build ``directory``'s scratch folder."""
    return write_byte_clip_tokenizer(directory / SCRATCH)


def clip_text_encoder(hidden: int = 32, *, layers: int = 2, intermediate: int | None = None,
                      with_projection: bool = False, seed: int = 0):
    """A CLIP text encoder over the byte tokenizer's 514 ids. ``with_projection`` gives the
    variant with a pooled projection head (SDXL's second encoder, both of SD3's CLIPs)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    model = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return seeded(seed, model, CLIPTextConfig(
        vocab_size=514, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=77,
        bos_token_id=512, eos_token_id=513, pad_token_id=513, projection_dim=hidden))


def t5_encoder(vocab_size: int, d_model: int = 32):
    """A two-layer T5 encoder (four heads, relative positions) for the character T5 tokenizer."""
    from transformers import T5Config, T5EncoderModel

    return seeded(0, T5EncoderModel, T5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=d_model // 4, d_ff=2 * d_model, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0))


def qwen2_5_vl_encoder(tokenizer, hidden: int = 32):
    """A two-layer Qwen2.5-VL over ``tokenizer``'s ids, with grouped-query attention (4 heads,
    2 key/value heads) and multimodal RoPE as in the real one; its one-block vision tower is
    there only because the class has one: text-to-image never feeds it an image."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    return seeded(0, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            # The three RoPE sections (time, height, width) split the head's 4 frequency pairs.
            rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6},
            bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>")),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=hidden, fullatt_block_indexes=[0]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>")))


def vae(channels: tuple[int, ...] = (16, 16, 32, 32), norm_groups: int = 8, sample_size: int = 64,
        latent_channels: int = 4, seed: int = 0, **extra):
    """An AutoencoderKL with one level per entry of ``channels``; ``extra`` sets the rest
    (scaling and shift factors, quant convs) as each family's own VAE has them."""
    from diffusers import AutoencoderKL

    # Four levels by default: 8x spatial downsampling (64x64 pixels -> 8x8 latents).
    return seeded(
        seed, AutoencoderKL, in_channels=3, out_channels=3, latent_channels=latent_channels,
        block_out_channels=channels, down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels), layers_per_block=1,
        norm_num_groups=norm_groups, sample_size=sample_size, **extra)


def deep_compression_vae(latent_channels: int = 32):
    """A four-level AutoencoderDC (8x; Sana's own has six levels, 32x): residual blocks at the
    top, linear-attention (EfficientViT) blocks below, with Sana's norms and activations."""
    from diffusers import AutoencoderDC

    blocks = ("ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock")
    channels, layers, scales = (8, 16, 32, 32), (1, 1, 1, 1), ((), (), (5,), (5,))
    return seeded(
        0, AutoencoderDC, in_channels=3, latent_channels=latent_channels, attention_head_dim=8,
        encoder_block_types=blocks, decoder_block_types=blocks,
        encoder_block_out_channels=channels, decoder_block_out_channels=channels,
        encoder_layers_per_block=layers, decoder_layers_per_block=layers,
        encoder_qkv_multiscales=scales, decoder_qkv_multiscales=scales,
        decoder_norm_types=("batch_norm", "batch_norm", "rms_norm", "rms_norm"),
        decoder_act_fns=("relu", "relu", "silu", "silu"), downsample_block_type="Conv",
        upsample_block_type="interpolate", scaling_factor=0.41407)
