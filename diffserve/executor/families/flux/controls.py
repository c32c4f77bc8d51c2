"""Flux's ControlNet (InstantX's kind, union models included): the control models it takes,
diffusers' ControlNet pipeline of each task, the class that stacks several models and the
keyword of the control images."""

from __future__ import annotations

from diffserve.wire.tasks import GENERATE, IMAGE_TO_IMAGE, INPAINT

CLASSES = ("FluxControlNetModel",)
PIPELINES = {GENERATE.name: "FluxControlNetPipeline",
             IMAGE_TO_IMAGE.name: "FluxControlNetImg2ImgPipeline",
             INPAINT.name: "FluxControlNetInpaintPipeline"}
MULTI = "FluxMultiControlNetModel"
IMAGE_KWARG = dict.fromkeys(PIPELINES, "control_image")
