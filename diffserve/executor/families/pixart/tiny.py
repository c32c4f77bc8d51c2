"""PixArt-Sigma (DiT with cross-attention, T5): tiny-pixart-sigma."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save, seeded
from diffserve.builders.components import t5_encoder, vae
from diffserve.builders.tokenizers import character_t5_tokenizer


def build(directory: Path) -> None:
    """PixArtSigmaPipeline: a two-block DiT with cross-attention to a T5 encoder, learned
    variance (8 output channels for 4 latent ones), 64x64 native.

    Its sample size is 32 latents, the smallest that the pipeline's resolution binning accepts
    (it raises for any size outside 32, 64, 128 and 256), so a call that leaves the size out
    gets 256x256. Serving uses 64x64: the position embedding is recomputed for any grid."""
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    t5_tokenizer = character_t5_tokenizer()
    # Cross-attention runs at the inner width (2 x 16), after the caption projection from T5's.
    transformer = seeded(
        0, PixArtTransformer2DModel, num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=8, num_layers=2, cross_attention_dim=32, caption_channels=32, sample_size=32,
        patch_size=2, use_additional_conditions=False)
    pipe = PixArtSigmaPipeline(
        tokenizer=t5_tokenizer, text_encoder=t5_encoder(len(t5_tokenizer)),
        vae=vae(scaling_factor=0.13025, force_upcast=False), transformer=transformer,
        # PixArt-Sigma's scheduler: DPM-Solver++ (2nd order), whose defaults are its settings.
        scheduler=DPMSolverMultistepScheduler())
    # clean_caption (on by default) needs bs4 and ftfy and silently turns itself off without
    # them; off, the prompt is only lower-cased, whatever is installed.
    save(pipe, directory, spatial_stride=16, guidance_scale=4.5,
         pipeline_kwargs={"clean_caption": False})


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-pixart-sigma": ("PixArt-Sigma (DiT with cross-attention, T5) with random weights, "
                          "64x64, 4 steps", build),
}
