"""Qwen-Image's ControlNet: the control models it takes, diffusers' ControlNet pipeline (it
generates only: diffusers' Qwen-Image ControlNet inpainting is an inpainting ControlNet, not a
control of an inpainting request), the class that stacks several models and the keyword of the
control images."""

from __future__ import annotations

from diffserve.wire.tasks import GENERATE

CLASSES = ("QwenImageControlNetModel",)
PIPELINES = {GENERATE.name: "QwenImageControlNetPipeline"}
MULTI = "QwenImageMultiControlNetModel"
IMAGE_KWARG = dict.fromkeys(PIPELINES, "control_image")
