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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from diffserve.models.shapes import WEIGHTS_DIR as SHAPES_WEIGHTS
from diffserve.models.tokenizers import (character_t5_tokenizer, gemma_tokenizer, qwen2_tokenizer,
                                         write_byte_clip_tokenizer, write_character_bert_tokenizer)

SERVING_DEFAULTS_FILE = "diffserve.json"
# Bump when a builder changes so that stale caches are rebuilt rather than reused.
_BUILD_VERSION = 1


def cache_root() -> Path:
    root = os.environ.get("DIFFSERVE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "diffserve"


def _clip_text_encoder(torch, hidden: int = 32, *, layers: int = 2, intermediate: int | None = None,
                       with_projection: bool = False, seed: int = 0):
    """A CLIP text encoder over the byte tokenizer's 514 ids. ``with_projection`` gives the
    variant with a pooled projection head (SDXL's second encoder, both of SD3's CLIPs)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    model = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    torch.manual_seed(seed)
    return model(CLIPTextConfig(
        vocab_size=514, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=77,
        bos_token_id=512, eos_token_id=513, pad_token_id=513, projection_dim=hidden))


def _t5_encoder(torch, vocab_size: int, d_model: int = 32):
    """A two-layer T5 encoder (four heads, relative positions) for the character T5 tokenizer."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    return T5EncoderModel(T5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=d_model // 4, d_ff=2 * d_model, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0))


def _vae(torch, channels: tuple[int, ...] = (16, 16, 32, 32), norm_groups: int = 8,
         sample_size: int = 64, latent_channels: int = 4, seed: int = 0, **extra):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    # Four levels by default: 8x spatial downsampling (64x64 pixels -> 8x8 latents).
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=channels,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels), layers_per_block=1,
        norm_num_groups=norm_groups, sample_size=sample_size, **extra)


@dataclass(frozen=True)
class SDSize:
    """The knobs that set a Stable Diffusion build's size, and so its cost per step."""

    image_size: int                  # native width and height in pixels (latents are 1/8 of it)
    unet_channels: tuple[int, ...]   # one UNet level each; all but the deepest have cross-attention
    unet_norm_groups: int
    text_hidden: int                 # CLIP width, which is also the UNet's cross-attention width
    text_layers: int
    text_intermediate: int
    vae_channels: tuple[int, ...]
    vae_norm_groups: int
    seeds: tuple[int, int, int] = (0, 0, 0)  # weight seeds of the UNet, VAE and text encoder


# tiny-sd: about 1.1M parameters in all, so cheap that per-request overheads dominate.
SD_TINY = SDSize(image_size=64, unet_channels=(32, 64), unet_norm_groups=8, text_hidden=32,
                 text_layers=2, text_intermediate=64, vae_channels=(16, 16, 32, 32), vae_norm_groups=8)
# sd-mid: about 36M parameters (UNet about 29M) at 128x128, costly enough per step for batching
# to matter the way it does with real models. Its seeds keep it byte-identical to the mid-size
# model the earlier benchmark figures were taken on.
SD_MID = SDSize(image_size=128, unet_channels=(96, 192, 384), unet_norm_groups=32, text_hidden=256,
                text_layers=4, text_intermediate=1024, vae_channels=(32, 64, 128, 128),
                vae_norm_groups=32, seeds=(0, 1, 2))


def build_tiny_sd(directory: Path, size: SDSize = SD_TINY) -> None:
    """StableDiffusionPipeline: a UNet with cross-attention, its size from ``size``."""
    import torch
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    levels = len(size.unet_channels)
    unet_seed, vae_seed, text_seed = size.seeds
    torch.manual_seed(unet_seed)
    unet = UNet2DConditionModel(
        sample_size=size.image_size // 8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=size.unet_channels,
        down_block_types=("CrossAttnDownBlock2D",) * (levels - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (levels - 1),
        cross_attention_dim=size.text_hidden, attention_head_dim=8,
        norm_num_groups=size.unet_norm_groups)
    pipe = StableDiffusionPipeline(
        vae=_vae(torch, channels=size.vae_channels, norm_groups=size.vae_norm_groups,
                 sample_size=size.image_size, seed=vae_seed),
        text_encoder=_clip_text_encoder(torch, size.text_hidden, layers=size.text_layers,
                                        intermediate=size.text_intermediate, seed=text_seed),
        tokenizer=write_byte_clip_tokenizer(directory / "_tok"), unet=unet,
        scheduler=DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                clip_sample=False, set_alpha_to_one=False, steps_offset=1),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    shutil.rmtree(directory / "_tok")
    pipe.save_pretrained(directory)
    _write_defaults(directory, width=size.image_size, height=size.image_size, spatial_stride=8,
                    num_inference_steps=4, guidance_scale=5.0)


def build_tiny_sdxl(directory: Path) -> None:
    """StableDiffusionXLPipeline: a two-level UNet conditioned on two CLIP encoders (their
    penultimate hidden states side by side, and the second one's pooled projection together
    with the size and crop ids), 64x64 native."""
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    # Two encoder widths that differ, as in SDXL (768 and 1280), so a mix-up cannot pass unseen.
    hidden, hidden_2, time_dim = 32, 64, 8
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2),
        cross_attention_dim=hidden + hidden_2, attention_head_dim=8, use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=time_dim,
        # Six micro-conditioning ids (original size, crop corner, target size), each embedded in
        # time_dim channels, next to the second encoder's pooled projection.
        projection_class_embeddings_input_dim=6 * time_dim + hidden_2, norm_num_groups=8)
    pipe = StableDiffusionXLPipeline(
        vae=_vae(torch, scaling_factor=0.13025, force_upcast=False),
        text_encoder=_clip_text_encoder(torch, hidden),
        text_encoder_2=_clip_text_encoder(torch, hidden_2, with_projection=True),
        tokenizer=write_byte_clip_tokenizer(directory / "_tok"),
        tokenizer_2=write_byte_clip_tokenizer(directory / "_tok"), unet=unet,
        # SDXL's own scheduler and its settings.
        scheduler=EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012,
                                         beta_schedule="scaled_linear", steps_offset=1,
                                         timestep_spacing="leading"),
        add_watermarker=False)
    shutil.rmtree(directory / "_tok")
    pipe.save_pretrained(directory)
    _write_defaults(directory, width=64, height=64, spatial_stride=8, num_inference_steps=4,
                    guidance_scale=5.0)


def build_tiny_sd3(directory: Path) -> None:
    """StableDiffusion3Pipeline: a two-block MM-DiT with flow matching, two CLIP encoders and a
    T5 encoder, 16-channel latents, 64x64 native."""
    import torch
    from diffusers import (FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)

    # SD3 joins the two CLIPs' hidden states channel-wise (32 + 64 here), pads them to the T5
    # width and puts the T5 tokens after them: the transformer's text input is T5-wide. Its
    # pooled input is both CLIPs' projections side by side.
    clip_l, clip_g, t5_dim = 32, 64, 128
    t5_tokenizer = character_t5_tokenizer()
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
        attention_head_dim=16, num_attention_heads=2, caption_projection_dim=32,
        joint_attention_dim=t5_dim, pooled_projection_dim=clip_l + clip_g)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(torch, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
                 shift_factor=0.0609, scaling_factor=1.5305),
        text_encoder=_clip_text_encoder(torch, clip_l, with_projection=True),
        tokenizer=write_byte_clip_tokenizer(directory / "_tok"),
        text_encoder_2=_clip_text_encoder(torch, clip_g, with_projection=True),
        tokenizer_2=write_byte_clip_tokenizer(directory / "_tok"),
        text_encoder_3=_t5_encoder(torch, len(t5_tokenizer), t5_dim), tokenizer_3=t5_tokenizer)
    shutil.rmtree(directory / "_tok")
    pipe.save_pretrained(directory)
    # SD3 pads T5 prompts to 256 tokens by default, far more text than image tokens here.
    _write_defaults(directory, width=64, height=64, spatial_stride=16, num_inference_steps=4,
                    guidance_scale=5.0, pipeline_kwargs={"max_sequence_length": 32})


def build_tiny_hunyuandit(directory: Path) -> None:
    """HunyuanDiTPipeline: a four-block DiT (one long skip) with BERT and T5 text encoders.

    A regression fixture as much as a model: HunyuanDiTPipeline's ``use_resolution_binning``
    (on by default) replaces any size outside its ten standard ones by the nearest of them, so a
    64x64 request comes back 1024x1024 unless the call passes ``use_resolution_binning=False``."""
    import torch
    from diffusers import DDPMScheduler, HunyuanDiT2DModel, HunyuanDiTPipeline
    from transformers import BertConfig, BertModel

    bert_tokenizer = write_character_bert_tokenizer(directory / "_tok")
    t5_tokenizer = character_t5_tokenizer()
    torch.manual_seed(0)
    # The pipeline always sends 77 BERT tokens and 256 T5 tokens (text_len, text_len_t5), and
    # pools the T5 tokens with 8 heads, so the T5 width must be a multiple of 8. The block count
    # must be even: the first half feeds long skips into the second (block 0 into block 3 here).
    transformer = HunyuanDiT2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=16,
        num_attention_heads=2, hidden_size=32, cross_attention_dim=32, cross_attention_dim_t5=32,
        pooled_projection_dim=16, text_len=77, text_len_t5=256)
    torch.manual_seed(0)
    bert = BertModel(BertConfig(
        vocab_size=len(bert_tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=77))
    pipe = HunyuanDiTPipeline(
        vae=_vae(torch, scaling_factor=0.13025, force_upcast=False), text_encoder=bert,
        tokenizer=bert_tokenizer, transformer=transformer,
        scheduler=DDPMScheduler(beta_start=0.00085, beta_end=0.03, beta_schedule="scaled_linear",
                                prediction_type="v_prediction", clip_sample=False, steps_offset=1),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        text_encoder_2=_t5_encoder(torch, len(t5_tokenizer)), tokenizer_2=t5_tokenizer)
    shutil.rmtree(directory / "_tok")
    pipe.save_pretrained(directory)
    _write_defaults(directory, width=64, height=64, spatial_stride=16, num_inference_steps=4,
                    guidance_scale=5.0)


def build_tiny_flux(directory: Path) -> None:
    """FluxPipeline: a one-block MM-DiT with flow matching, CLIP + T5 text encoders, 64x64 native."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    t5_tokenizer = character_t5_tokenizer()
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6))
    t5 = _t5_encoder(torch, len(t5_tokenizer))
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


def _qwen2_5_vl_encoder(torch, tokenizer, hidden: int = 32):
    """A two-layer Qwen2.5-VL over ``tokenizer``'s ids, with grouped-query attention (4 heads,
    2 key/value heads) and multimodal RoPE as in the real one; its one-block vision tower is
    there only because the class has one: text-to-image never feeds it an image."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
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


def build_tiny_qwen_image(directory: Path) -> None:
    """QwenImagePipeline: a two-block MM-DiT with flow matching over 2x2-packed latents of a 3D
    (video-style) VAE, conditioned on a Qwen2.5-VL's last hidden states, 64x64 native."""
    import torch
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,
                           QwenImagePipeline, QwenImageTransformer2DModel)

    # The pipeline wraps each prompt in a chat template (set in its __init__, hence read from a
    # pipeline with no components) and drops the template's first 34 tokens: with Qwen's
    # vocabulary, all that precedes the prompt. Learning the template's words keeps it so.
    template = QwenImagePipeline(None, None, None, None, None).prompt_template_encode
    tokenizer = qwen2_tokenizer([template])
    hidden = 32
    torch.manual_seed(0)
    # Packed latents have 4x the VAE's 16 channels in, and the transformer gives 16 back per
    # 2x2 patch. The RoPE axes (frame, height, width) add up to the head width.
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=hidden, axes_dims_rope=(4, 6, 6))
    torch.manual_seed(0)
    # Three spatial downsamplings (8x), two of them also in time, as in the real VAE, whose
    # per-channel latent mean and std are the class defaults.
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])
    pipe = QwenImagePipeline(
        # Qwen-Image's own scheduler settings: the shift grows with the image token count.
        scheduler=FlowMatchEulerDiscreteScheduler(
            base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
            shift=1.0, shift_terminal=0.02, use_dynamic_shifting=True,
            time_shift_type="exponential"),
        vae=vae, text_encoder=_qwen2_5_vl_encoder(torch, tokenizer, hidden), tokenizer=tokenizer,
        transformer=transformer)
    pipe.save_pretrained(directory)
    # guidance_scale is true_cfg_scale's default: the pipeline's own guidance_scale only feeds
    # guidance-distilled transformers, which this one is not.
    _write_defaults(directory, width=64, height=64, spatial_stride=16, num_inference_steps=4,
                    guidance_scale=4.0)


def build_tiny_pixart_sigma(directory: Path) -> None:
    """PixArtSigmaPipeline: a two-block DiT with cross-attention to a T5 encoder, learned
    variance (8 output channels for 4 latent ones), 64x64 native.

    Its sample size is 32 latents, the smallest that the pipeline's resolution binning accepts
    (it raises for any size outside 32, 64, 128 and 256), so a call that leaves the size out
    gets 256x256. Serving uses 64x64: the position embedding is recomputed for any grid."""
    import torch
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    t5_tokenizer = character_t5_tokenizer()
    torch.manual_seed(0)
    # Cross-attention runs at the inner width (2 x 16), after the caption projection from T5's.
    transformer = PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=32, caption_channels=32, sample_size=32, patch_size=2,
        use_additional_conditions=False)
    pipe = PixArtSigmaPipeline(
        tokenizer=t5_tokenizer, text_encoder=_t5_encoder(torch, len(t5_tokenizer)),
        vae=_vae(torch, scaling_factor=0.13025, force_upcast=False), transformer=transformer,
        # PixArt-Sigma's scheduler: DPM-Solver++ (2nd order), whose defaults are its settings.
        scheduler=DPMSolverMultistepScheduler())
    pipe.save_pretrained(directory)
    # clean_caption (on by default) needs bs4 and ftfy and silently turns itself off without
    # them; off, the prompt is only lower-cased, whatever is installed.
    _write_defaults(directory, width=64, height=64, spatial_stride=16, num_inference_steps=4,
                    guidance_scale=4.5, pipeline_kwargs={"clean_caption": False})


def _deep_compression_vae(torch, latent_channels: int = 32):
    """A four-level AutoencoderDC (8x; Sana's own has six levels, 32x): residual blocks at the
    top, linear-attention (EfficientViT) blocks below, with Sana's norms and activations."""
    from diffusers import AutoencoderDC

    blocks = ("ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock")
    channels, layers, scales = (8, 16, 32, 32), (1, 1, 1, 1), ((), (), (5,), (5,))
    torch.manual_seed(0)
    return AutoencoderDC(
        in_channels=3, latent_channels=latent_channels, attention_head_dim=8,
        encoder_block_types=blocks, decoder_block_types=blocks,
        encoder_block_out_channels=channels, decoder_block_out_channels=channels,
        encoder_layers_per_block=layers, decoder_layers_per_block=layers,
        encoder_qkv_multiscales=scales, decoder_qkv_multiscales=scales,
        decoder_norm_types=("batch_norm", "batch_norm", "rms_norm", "rms_norm"),
        decoder_act_fns=("relu", "relu", "silu", "silu"), downsample_block_type="Conv",
        upsample_block_type="interpolate", scaling_factor=0.41407)


def build_tiny_sana(directory: Path) -> None:
    """SanaPipeline: a two-block linear-attention DiT (patch size 1, no position embedding) with
    cross-attention to a Gemma 2 encoder, over a deep-compression VAE, 64x64 native.

    Sizes must be multiples of 32 (the pipeline checks). The sample size, 16 latents, is the
    smallest that resolution binning accepts; it sets nothing else, since a call that leaves the
    size out gets 1024x1024 whatever it is."""
    import inspect

    import torch
    from diffusers import DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    # By default each prompt goes after a long instruction; learning its words keeps it about
    # as many tokens as with Gemma's vocabulary rather than one per character.
    instruction = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"]
    tokenizer = gemma_tokenizer(instruction.default)
    hidden = 32
    torch.manual_seed(0)
    text_encoder = Gemma2Model(Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        query_pre_attn_scalar=16, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id))
    torch.manual_seed(0)
    transformer = SanaTransformer2DModel(
        in_channels=32, out_channels=32, num_attention_heads=2, attention_head_dim=16,
        num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=16,
        cross_attention_dim=32, caption_channels=hidden, sample_size=16, patch_size=1)
    pipe = SanaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=_deep_compression_vae(torch),
        transformer=transformer,
        # Sana's scheduler: DPM-Solver++ on flow-matching sigmas, shifted by 3.
        scheduler=DPMSolverMultistepScheduler(prediction_type="flow_prediction",
                                              use_flow_sigmas=True, flow_shift=3.0))
    pipe.save_pretrained(directory)
    _write_defaults(directory, width=64, height=64, spatial_stride=32, num_inference_steps=4,
                    guidance_scale=4.5)


# Models whose trained weights ship inside the package: name -> (description, directory).
PACKAGED: dict[str, tuple[str, Path]] = {
    "shapes": ("Stable Diffusion trained on CPU to draw a coloured circle, square or triangle on a "
               "plain background, 32x32, 20 steps (see docs/shapes.md)", SHAPES_WEIGHTS),
}

EMBEDDED: dict[str, tuple[str, Callable[[Path], None]]] = {
    "tiny-sd": ("Stable Diffusion (UNet) with random weights, 64x64, 4 steps", build_tiny_sd),
    "sd-mid": ("Stable Diffusion (UNet) with random weights, about 36M parameters, 128x128, 4 steps: "
               "costly enough per step for batching to matter, for benchmarks",
               partial(build_tiny_sd, size=SD_MID)),
    "tiny-sdxl": ("Stable Diffusion XL (UNet, two CLIP encoders) with random weights, 64x64, 4 steps",
                  build_tiny_sdxl),
    "tiny-sd3": ("Stable Diffusion 3 (MM-DiT, flow matching, two CLIPs + T5) with random weights, "
                 "64x64, 4 steps", build_tiny_sd3),
    "tiny-flux": ("Flux (MM-DiT, flow matching) with random weights, 64x64, 4 steps", build_tiny_flux),
    "tiny-hunyuandit": ("HunyuanDiT (DiT, BERT + T5) with random weights, 64x64, 4 steps; a regression "
                        "fixture: its pipeline turns a 64x64 request into 1024x1024 unless called "
                        "with use_resolution_binning=False", build_tiny_hunyuandit),
    "tiny-qwen-image": ("Qwen-Image (MM-DiT, flow matching, Qwen2.5-VL text encoder) with "
                        "random weights, 64x64, 4 steps", build_tiny_qwen_image),
    "tiny-pixart-sigma": ("PixArt-Sigma (DiT with cross-attention, T5) with random weights, "
                          "64x64, 4 steps", build_tiny_pixart_sigma),
    "tiny-sana": ("Sana (linear-attention DiT, deep-compression VAE, Gemma 2 text encoder) "
                  "with random weights, 64x64, 4 steps", build_tiny_sana),
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
