"""A request's ControlNet controls: checked against the served model (its family takes controls,
each names a served control model, its window is a window, its mode is one the model has, the
stack is not longer than ``--max-controls-per-request``), and their images decoded and resized
to the request's size as diffusers' ControlNet pipelines resize them (a plain resize, Lanczos).
Every refusal is a 400 naming the control's field (``controls[1].model``)."""

from __future__ import annotations

import base64
import binascii
import re

import numpy as np

from diffserve.config.flags import ServerConfig
from diffserve.errors import invalid_request
from diffserve.frontend.uploads import open_image
from diffserve.wire.model_info import ModelInfo
from diffserve.wire.tasks import Task
from diffserve.wire.request import WITH_CONTROLS, Control

_DATA_URL = re.compile(r"^data:image/[a-zA-Z+.-]+;base64,", re.ASCII)


def control_stack(controls, info: ModelInfo, config: ServerConfig, task: Task) -> tuple[Control, ...]:
    """The request's controls (``controls``: the body's :class:`ControlRef` list, or None)."""
    if not controls:
        return ()
    if not info.controls_supported:
        raise invalid_request(f"model {info.name!r} ({info.pipeline_class}) takes no controls: "
                              f"ControlNet runs with {_controlnet_families()}", "controls",
                              "unsupported_parameter")
    if len(controls) > config.max_controls_per_request:
        raise invalid_request(f"{len(controls)} controls; this server stacks at most "
                              f"{config.max_controls_per_request} per request "
                              "(--max-controls-per-request)", "controls", "too_many_controls")
    key = task.name + WITH_CONTROLS
    if key not in info.task_modes:
        why = info.unavailable_tasks.get(key, f"model {info.name!r} serves no control model "
                                              "(start it with --controlnet NAME=PATH)")
        raise invalid_request(f"controls are not served with {task.name} on this model: {why}",
                              "controls", "unsupported_parameter")
    stack = []
    for i, ref in enumerate(controls):
        served = info.control_model(ref.model)
        if served is None:
            names = ", ".join(m.name for m in info.control_models) or "none"
            raise invalid_request(f"no control model {ref.model!r} is served (served: {names})",
                                  f"controls[{i}].model", "control_model_not_found")
        if ref.start >= ref.end:
            raise invalid_request(f"start={ref.start:g} is not before end={ref.end:g}: a control "
                                  "acts from start to end, fractions of the steps",
                                  f"controls[{i}].start", "invalid_value")
        if served.modes and ref.mode is None:
            raise invalid_request(f"{ref.model!r} is a union model: give its control type as mode "
                                  f"(0 to {served.modes - 1})", f"controls[{i}].mode",
                                  "missing_required_parameter")
        if ref.mode is not None and not ref.mode < served.modes:
            lacks = (f"has control types 0 to {served.modes - 1}" if served.modes
                     else "is not a union model: leave mode out")
            raise invalid_request(f"mode={ref.mode} is not one {ref.model!r} has: it {lacks}",
                                  f"controls[{i}].mode", "invalid_value")
        stack.append(Control(ref.model, float(ref.scale), float(ref.start), float(ref.end),
                             ref.mode))
    return tuple(stack)


def control_cost(stack: tuple[Control, ...], info: ModelInfo) -> float:
    """What the stack adds to an image's cost, as a share of it: each control model runs once a
    step on the image's rows (its parameters over the denoiser's)."""
    return sum(info.control_model(c.model).cost for c in stack)


def control_frames(controls, width: int, height: int, max_pixels: int) -> list[np.ndarray]:
    """Each control's image as uint8 RGB (height, width, 3), resized to the request's size."""
    from PIL import Image

    frames = []
    for i, ref in enumerate(controls or ()):
        param = f"controls[{i}].image"
        text = _DATA_URL.sub("", ref.image.strip(), count=1)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise invalid_request(f"{param!r} is not base64 (or a data URL of a base64 image)",
                                  param, "invalid_image") from None
        # As diffusers' ControlNet pipelines take an image: RGB (alpha dropped), then resized.
        image = open_image(data, param, max_pixels).convert("RGB")
        resized = image.resize((width, height), Image.Resampling.LANCZOS)
        frames.append(np.ascontiguousarray(np.asarray(resized, np.uint8)))
    return frames


def _controlnet_families() -> str:
    """The families that take ControlNet models, as a sentence: the family folders that hold
    ControlNet tables (no step adapter and no torch is imported for it)."""
    from diffserve.executor.families import controlnet_titles

    *rest, last = controlnet_titles()
    return f"{', '.join(rest)} and {last}" if rest else last
