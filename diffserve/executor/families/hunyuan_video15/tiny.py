"""HunyuanVideo 1.5 (3D DiT, video VAE, Qwen2.5-VL and ByT5 text encoders): tiny-hunyuan-video15."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.tokenizers import qwen2_tokenizer

FRAMES = 9  # native frame count: 2k+1, five latent frames
# Qwen2-VL's chat layout, which the pipeline applies to every prompt before it drops the
# template's leading tokens.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tokenizers() -> dict:
    """A Qwen2 tokenizer that learned the system message's words (the prompt's template is then
    about as many tokens as with Qwen's vocabulary), and ByT5's (bytes: no files)."""
    from diffusers import HunyuanVideo15Pipeline
    from transformers import ByT5Tokenizer

    system = HunyuanVideo15Pipeline.__init__.__code__.co_consts  # the message is a constant
    message = next(c for c in system if isinstance(c, str) and c.startswith("You are a helpful"))
    tokenizer = qwen2_tokenizer([f"<|im_start|>system\n{message}<|im_end|>\n<|im_start|>user\n"])
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return {"tokenizer": tokenizer, "tokenizer_2": ByT5Tokenizer()}


def text_encoders() -> dict:
    """Qwen2.5-VL's text model (16 wide, two layers) and a ByT5 encoder for quoted text, with
    their tokenizers."""
    from transformers import (
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    made = tokenizers()
    tokenizer, glyphs = made["tokenizer"], made["tokenizer_2"]
    ids = tokenizer.convert_tokens_to_ids
    encoder = seeded(0, Qwen2_5_VLTextModel, Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]}))
    encoder_2 = seeded(0, T5EncoderModel, T5Config(
        vocab_size=len(glyphs), d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8))
    return dict(tokenizer=tokenizer, text_encoder=encoder, tokenizer_2=glyphs,
                text_encoder_2=encoder_2)


def denoiser_and_vae(task_type: str) -> dict:
    """The one-block 3D DiT (and one refiner block) for ``task_type``, and the VAE 8x spatial
    and 2x temporal."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel

    transformer = seeded(
        0, HunyuanVideo15Transformer3DModel, in_channels=9, out_channels=4,
        num_attention_heads=2, attention_head_dim=8, num_layers=1, num_refiner_layers=1,
        mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=32,
        image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=32, task_type=task_type)
    vae = seeded(
        0, AutoencoderKLHunyuanVideo15, in_channels=3, out_channels=3, latent_channels=4,
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, spatial_compression_ratio=8,
        temporal_compression_ratio=2, downsample_match_channel=False,
        upsample_match_channel=False)
    return {"transformer": transformer, "vae": vae}


def build(directory: Path) -> None:
    """HunyuanVideo15Pipeline: a one-block 3D DiT (and one refiner block), a VAE 8x spatial and
    2x temporal, 32x32 native, 9 frames, 4 steps."""
    _build(directory, "HunyuanVideo15Pipeline", denoiser_and_vae("t2v"))


def _build(directory: Path, pipeline: str, modules: dict) -> None:
    """``pipeline`` over ``modules`` and the text encoders, with its schedule and guider, saved
    with its serving defaults."""
    import diffusers

    pipe = getattr(diffusers, pipeline)(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
        guider=diffusers.ClassifierFreeGuidance(guidance_scale=6.0), **modules,
        **text_encoders())
    save(pipe, directory, spatial_stride=16, guidance_scale=6.0, size=32, num_frames=FRAMES,
         fps=24)


def image_encoder() -> dict:
    """SigLIP's vision tower (12 wide: the DiT's image embedding width, one layer, 16 tokens of
    a 32x32 picture) and its image processor."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    encoder = seeded(0, SiglipVisionModel, SiglipVisionConfig(
        hidden_size=12, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8))
    processor = SiglipImageProcessor(size={"height": 32, "width": 32})
    return {"image_encoder": encoder, "feature_extractor": processor}


def build_image_to_video(directory: Path) -> None:
    """HunyuanVideo15ImageToVideoPipeline: the same modules as :func:`build` (an image-to-video
    DiT) and a SigLIP image encoder; 32x32, 9 frames, 4 steps."""
    _build(directory, "HunyuanVideo15ImageToVideoPipeline",
           {**denoiser_and_vae("i2v"), **image_encoder()})


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-hunyuan-video15": ("HunyuanVideo 1.5 text-to-video (3D DiT, video VAE, Qwen2.5-VL and "
                             "ByT5) with random weights, 32x32, 9 frames, 4 steps", build),
    "tiny-hunyuan-video15-i2v": (("HunyuanVideo 1.5 image-to-video (3D DiT, video VAE, "
                                  "Qwen2.5-VL and ByT5, SigLIP image encoder) with random "
                                  "weights, 32x32, 9 frames, 4 steps"), build_image_to_video),
}
