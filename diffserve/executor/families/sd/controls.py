"""Stable Diffusion 1.x/2.x's ControlNet: the control models it takes, diffusers' ControlNet
pipeline of each task, the class that stacks several models, the keyword of the control images
and how a stack takes them."""

from __future__ import annotations

from diffserve.executor.families.base import BY_ROW, SHARED
from diffserve.wire.tasks import GENERATE, IMAGE_TO_IMAGE, INPAINT

CLASSES = ("ControlNetModel",)
PIPELINES = {GENERATE.name: "StableDiffusionControlNetPipeline",
             IMAGE_TO_IMAGE.name: "StableDiffusionControlNetImg2ImgPipeline",
             INPAINT.name: "StableDiffusionControlNetInpaintPipeline"}
MULTI = "MultiControlNetModel"
IMAGE_KWARG = {GENERATE.name: "image", IMAGE_TO_IMAGE.name: "control_image",
               INPAINT.name: "control_image"}
STACKS = {GENERATE.name: BY_ROW, IMAGE_TO_IMAGE.name: SHARED, INPAINT.name: SHARED}
