"""Qwen-Image-Edit and Qwen-Image-Edit-Plus (Qwen-Image's MM-DiT, its 3D VAE, a Qwen2.5-VL that
sees the input images through its vision tower): tiny-qwen-image-edit, tiny-qwen-image-edit-plus.

Their pipelines encode every input image at about 1024x1024 pixels (whatever the output size),
as the real ones do: this VAE keeps the real 8x geometry so that token counts match, and an edit
costs seconds on a CPU for that encoding alone."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save
from diffserve.builders.components import qwen2_5_vl_encoder
from diffserve.executor.families.qwen_image.tiny import denoiser_and_vae, scheduler
from diffserve.builders.tokenizers import qwen2_tokenizer

# Qwen2.5-VL's image settings: 14-pixel patches merged 2x2, frames of 2, CLIP's mean and std.
VL_IMAGE_PROCESSOR = dict(
    do_resize=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
    image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
    do_convert_rgb=True, min_pixels=3136, max_pixels=12845056, patch_size=14,
    temporal_patch_size=2, merge_size=2)


def _components(pipeline_cls) -> dict:
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

    from diffserve.builders.compat import allow_processors_without_torchvision

    allow_processors_without_torchvision()
    # The pipeline drops its template's first 64 tokens (all that precedes the instruction with
    # Qwen's vocabulary): learning the template's words (and Edit-Plus's image labels) keeps it so.
    template = pipeline_cls(None, None, None, None, None, None).prompt_template_encode
    tokenizer = qwen2_tokenizer([template, "Picture 1: Picture 2: Picture 3: "])
    hidden = 32
    transformer, vae = denoiser_and_vae(hidden)
    return dict(
        scheduler=scheduler(),
        vae=vae, text_encoder=qwen2_5_vl_encoder(tokenizer, hidden), tokenizer=tokenizer,
        processor=Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**VL_IMAGE_PROCESSOR),
                                   tokenizer=tokenizer),
        transformer=transformer)


def build(directory: Path) -> None:
    """QwenImageEditPipeline: edits one input image by instruction, 64x64 native output."""
    from diffusers import QwenImageEditPipeline

    save(QwenImageEditPipeline(**_components(QwenImageEditPipeline)), directory,
         spatial_stride=16, guidance_scale=4.0)


def build_plus(directory: Path) -> None:
    """QwenImageEditPlusPipeline (Qwen-Image-Edit-2509): one to three input images."""
    from diffusers import QwenImageEditPlusPipeline

    save(QwenImageEditPlusPipeline(**_components(QwenImageEditPlusPipeline)), directory,
         spatial_stride=16, guidance_scale=4.0)


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-qwen-image-edit": ("Qwen-Image-Edit (Qwen-Image edited by instruction: the input image "
                             "through the VAE and the Qwen2.5-VL) with random weights, 64x64, 4 "
                             "steps", build),
    "tiny-qwen-image-edit-plus": ("Qwen-Image-Edit-Plus (2509: one to three input images) with "
                                  "random weights, 64x64, 4 steps", build_plus),
}
