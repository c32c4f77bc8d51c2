"""FLUX.1 Kontext (Flux with reference-image tokens, guidance embedding): tiny-flux-kontext."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save
from diffserve.executor.families.flux.tiny import components


def build(directory: Path) -> None:
    """FluxKontextPipeline: a one-block MM-DiT with a guidance embedding (as Kontext [dev]),
    CLIP + T5 text encoders, 64x64 native; edits put the input image's tokens beside the
    generated ones."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline

    pipe = FluxKontextPipeline(
        # FLUX.1's schedule: shifted by the image's token count.
        scheduler=FlowMatchEulerDiscreteScheduler(
            base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
            shift=3.0, use_dynamic_shifting=True),
        **components(directory, guidance_embeds=True))
    save(pipe, directory, spatial_stride=16, guidance_scale=2.5,
         pipeline_kwargs={"max_sequence_length": 64})


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-flux-kontext": ("FLUX.1 Kontext (Flux with reference-image tokens: instruction edits) "
                          "with random weights, 64x64, 4 steps", build),
}
