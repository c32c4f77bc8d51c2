"""Sana (linear-attention DiT, deep-compression VAE, Gemma 2 text encoder): tiny-sana."""

from __future__ import annotations

import inspect
from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.components import deep_compression_vae
from diffserve.builders.tokenizers import gemma_tokenizer


def build(directory: Path) -> None:
    """SanaPipeline: a two-block linear-attention DiT (patch size 1, no position embedding) with
    cross-attention to a Gemma 2 encoder, over a deep-compression VAE, 64x64 native.

    Sizes must be multiples of 32 (the pipeline checks). The sample size, 16 latents, is the
    smallest that resolution binning accepts; it sets nothing else, since a call that leaves the
    size out gets 1024x1024 whatever it is."""
    from diffusers import DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    # By default each prompt goes after a long instruction; learning its words keeps it about
    # as many tokens as with Gemma's vocabulary rather than one per character.
    instruction = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"]
    tokenizer = gemma_tokenizer(instruction.default)
    hidden = 32
    text_encoder = seeded(0, Gemma2Model, Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        query_pre_attn_scalar=16, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id))
    transformer = seeded(
        0, SanaTransformer2DModel, in_channels=32, out_channels=32, num_attention_heads=2,
        attention_head_dim=16, num_layers=2, num_cross_attention_heads=2,
        cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=hidden,
        sample_size=16, patch_size=1)
    pipe = SanaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=deep_compression_vae(),
        transformer=transformer,
        # Sana's scheduler: DPM-Solver++ on flow-matching sigmas, shifted by 3.
        scheduler=DPMSolverMultistepScheduler(prediction_type="flow_prediction",
                                              use_flow_sigmas=True, flow_shift=3.0))
    save(pipe, directory, spatial_stride=32, guidance_scale=4.5)


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-sana": ("Sana (linear-attention DiT, deep-compression VAE, Gemma 2 text encoder) "
                  "with random weights, 64x64, 4 steps", build),
}
