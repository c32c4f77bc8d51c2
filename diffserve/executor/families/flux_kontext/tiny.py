"""FLUX.1 Kontext (Flux with reference-image tokens, guidance embedding): tiny-flux-kontext."""

from __future__ import annotations

from pathlib import Path

from diffserve.builders.common import save
from diffserve.executor.families.flux.tiny import components, dev_schedule


def build(directory: Path) -> None:
    """FluxKontextPipeline: a one-block MM-DiT with a guidance embedding (as Kontext [dev]),
    CLIP + T5 text encoders, 64x64 native; edits put the input image's tokens beside the
    generated ones."""
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline(
        scheduler=dev_schedule(),
        **components(directory, guidance_embeds=True))
    save(pipe, directory, spatial_stride=16, guidance_scale=2.5,
         pipeline_kwargs={"max_sequence_length": 64})


# name -> (description, builder); a builder writes the model into the directory it is given.
EMBEDDED = {
    "tiny-flux-kontext": ("FLUX.1 Kontext (Flux with reference-image tokens: instruction edits) "
                          "with random weights, 64x64, 4 steps", build),
}
