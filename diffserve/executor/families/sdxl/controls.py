"""SDXL's ControlNet: Stable Diffusion's kind of control model (``sd/controls.py``), its own
pipelines, each taking one image per model for the whole call."""

from __future__ import annotations

from diffserve.executor.families.base import SHARED
from diffserve.wire.tasks import GENERATE, IMAGE_TO_IMAGE, INPAINT

PIPELINES = {GENERATE.name: "StableDiffusionXLControlNetPipeline",
             IMAGE_TO_IMAGE.name: "StableDiffusionXLControlNetImg2ImgPipeline",
             INPAINT.name: "StableDiffusionXLControlNetInpaintPipeline"}
STACKS = dict.fromkeys(PIPELINES, SHARED)
