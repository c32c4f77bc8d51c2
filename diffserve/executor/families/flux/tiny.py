"""Flux (MM-DiT, flow matching, CLIP + T5): tiny-flux, and flux-mid (deep enough that its
transformer is most of a step, for benchmarks)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.components import clip_text_encoder, clip_tokenizer, t5_encoder, vae
from diffserve.builders.tokenizers import character_t5_tokenizer


# flux-mid's transformer: 2 double- and 4 single-stream blocks of width 256 (about 9M
# parameters), at 128x128 (64 image tokens beside 64 text tokens).
MID = dict(num_layers=2, num_single_layers=4, attention_head_dim=64, num_attention_heads=4,
           axes_dims_rope=(16, 24, 24))


def build(directory: Path, transformer: dict | None = None, native: int = 64) -> None:
    """FluxPipeline: a one-block MM-DiT with flow matching, CLIP + T5 text encoders, 64x64 native
    (``transformer``: other transformer arguments; ``native``: another native size)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(),
                        **components(directory, transformer=transformer))
    # Flux pads T5 prompts to 512 tokens by default; 64 is plenty here and much faster.
    save(pipe, directory, spatial_stride=16, guidance_scale=3.5, size=native,
         pipeline_kwargs={"max_sequence_length": 64})


def dev_schedule():
    """FLUX.1 [dev]'s schedule (Kontext's and Fill's too): shifted by the image's token count."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5,
                                           max_image_seq_len=4096, max_shift=1.15, shift=3.0,
                                           use_dynamic_shifting=True)


def components(directory: Path, guidance_embeds: bool = False,
               transformer: dict | None = None) -> dict:
    """A one-block MM-DiT (with a guidance embedding where ``guidance_embeds``, as FLUX.1 [dev]
    and Kontext; ``transformer``: other arguments of it), Flux's VAE, CLIP and T5 with their
    tokenizers: all but the scheduler."""
    from diffusers import FluxTransformer2DModel

    t5_tokenizer = character_t5_tokenizer()
    shape = dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                 axes_dims_rope=(4, 6, 6)) | (transformer or {})
    transformer = seeded(
        0, FluxTransformer2DModel, patch_size=1, in_channels=16, joint_attention_dim=32,
        pooled_projection_dim=32, guidance_embeds=guidance_embeds, **shape)
    return dict(
        transformer=transformer,
        vae=vae(use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
                scaling_factor=1.5035),
        text_encoder=clip_text_encoder(), tokenizer=clip_tokenizer(directory),
        text_encoder_2=t5_encoder(len(t5_tokenizer)), tokenizer_2=t5_tokenizer)


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-flux": ("Flux (MM-DiT, flow matching) with random weights, 64x64, 4 steps", build),
    "flux-mid": ("Flux with random weights, about 9M parameters (2 double- and 4 single-stream "
                 "blocks of width 256), 128x128, 4 steps: its transformer is most of a step, "
                 "for benchmarks", partial(build, transformer=MID, native=128)),
}
