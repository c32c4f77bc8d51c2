"""FLUX.1 Fill [dev]'s released architecture for ``random:flux.1-fill-dev`` (and
``random:flux.1-fill-dev:tiny``): FLUX.1 [dev]'s modules, the transformer's input widened to the
latents', the masked image's and the mask's values of a token."""

from __future__ import annotations

from dataclasses import replace

from diffserve.builders.random.parts import FULL, Module
from diffserve.executor.families.flux.architecture import FLUX_1_DEV

# A token: 2x2 latent cells of 16 channels (64), the masked image's the same (64), and the mask's
# 2x2 cells of 8x8 pixels (256); the prediction is the latents' 64.
FILL_CHANNELS = dict(in_channels=384, out_channels=64)

_flux = FLUX_1_DEV.modules["transformer"]
FLUX_1_FILL_DEV = replace(
    FLUX_1_DEV, pipeline="FluxFillPipeline",
    description="FLUX.1 Fill [dev]: FLUX.1 [dev]'s 12B MM-DiT (19 double and 38 single blocks) "
    "conditioned on the masked image and the mask, CLIP-L and T5-XXL, guidance as an embedding",
    modules={**FLUX_1_DEV.modules,
             "transformer": Module(_flux.library, _flux.cls, {**_flux.config, **FILL_CHANNELS},
                                   _flux.tiny)},
    defaults=lambda scale: {**FLUX_1_DEV.defaults(scale), "guidance_scale": 30.0,
                            "num_inference_steps": 50 if scale == FULL else 4})


ARCHITECTURES = {"flux.1-fill-dev": FLUX_1_FILL_DEV}
