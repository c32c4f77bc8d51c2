"""Embedded tiny models: real diffusers pipelines built offline from small configs.

Their weights are random (drawn from a fixed seed), so they make noise-like images; they exist
so that the whole server runs, and is tested, on any CPU with no download. Each is built once
and cached on disk as an ordinary diffusers pipeline directory (``save_pretrained`` layout plus
``diffserve.json``), which is then loaded like any other local model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from diffserve.models.shapes import WEIGHTS_DIR as SHAPES_WEIGHTS
from diffserve.models.tokenizers import character_t5_tokenizer, write_byte_clip_tokenizer

SERVING_DEFAULTS_FILE = "diffserve.json"
# Bump when a builder changes so that stale caches are rebuilt rather than reused.
_BUILD_VERSION = 1


def cache_root() -> Path:
    root = os.environ.get("DIFFSERVE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "diffserve"


def _clip_text_encoder(torch, hidden: int = 32):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    return CLIPTextModel(CLIPTextConfig(
        vocab_size=514, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, bos_token_id=512, eos_token_id=513,
        pad_token_id=513, projection_dim=hidden))


def _vae(torch, **extra):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    # Four levels: 8x spatial downsampling (64x64 pixels -> 8x8 latents), 4 latent channels.
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16, 32, 32),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1, norm_num_groups=8, sample_size=64, **extra)


def build_tiny_sd(directory: Path) -> None:
    """StableDiffusionPipeline: a two-level UNet with cross-attention, 64x64 native."""
    import torch
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=8)
    pipe = StableDiffusionPipeline(
        vae=_vae(torch), text_encoder=_clip_text_encoder(torch),
        tokenizer=write_byte_clip_tokenizer(directory / "_tok"), unet=unet,
        scheduler=DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                clip_sample=False, set_alpha_to_one=False, steps_offset=1),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    shutil.rmtree(directory / "_tok")
    pipe.save_pretrained(directory)
    _write_defaults(directory, width=64, height=64, spatial_stride=8, num_inference_steps=4,
                    guidance_scale=5.0)


def build_tiny_flux(directory: Path) -> None:
    """FluxPipeline: a one-block MM-DiT with flow matching, CLIP + T5 text encoders, 64x64 native."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    t5_tokenizer = character_t5_tokenizer()
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6))
    torch.manual_seed(0)
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0))
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), transformer=transformer,
        vae=_vae(torch, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
                 scaling_factor=1.5035),
        text_encoder=_clip_text_encoder(torch), tokenizer=write_byte_clip_tokenizer(directory / "_tok"),
        text_encoder_2=t5, tokenizer_2=t5_tokenizer)
    shutil.rmtree(directory / "_tok")
    pipe.save_pretrained(directory)
    # Flux pads T5 prompts to 512 tokens by default; 64 is plenty here and much faster.
    _write_defaults(directory, width=64, height=64, spatial_stride=16, num_inference_steps=4,
                    guidance_scale=3.5, pipeline_kwargs={"max_sequence_length": 64})


# Models whose trained weights ship inside the package: name -> (description, directory).
PACKAGED: dict[str, tuple[str, Path]] = {
    "shapes": ("Stable Diffusion trained on CPU to draw a coloured circle, square or triangle on a "
               "plain background, 32x32, 20 steps (see docs/shapes.md)", SHAPES_WEIGHTS),
}

EMBEDDED: dict[str, tuple[str, Callable[[Path], None]]] = {
    "tiny-sd": ("Stable Diffusion (UNet) with random weights, 64x64, 4 steps", build_tiny_sd),
    "tiny-flux": ("Flux (MM-DiT, flow matching) with random weights, 64x64, 4 steps", build_tiny_flux),
}


def _write_defaults(directory: Path, **defaults) -> None:
    (directory / SERVING_DEFAULTS_FILE).write_text(json.dumps(defaults, indent=2) + "\n")


def embedded_path(name: str) -> Path:
    """Directory of embedded model ``name``, building it first if it is not cached yet.

    The build goes to a temporary directory that is renamed into place, so concurrent first
    uses (several servers or test workers) never see a half-written model."""
    if name not in EMBEDDED:
        raise KeyError(name)
    target = cache_root() / "models" / f"{name}-v{_BUILD_VERSION}"
    if (target / SERVING_DEFAULTS_FILE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        EMBEDDED[name][1](staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / SERVING_DEFAULTS_FILE).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
