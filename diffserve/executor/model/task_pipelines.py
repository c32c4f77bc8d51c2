"""Which tasks a loaded pipeline can serve, and the pipeline that runs each: the loaded one, or
diffusers' auto-pipeline of its family built from the same components."""

from __future__ import annotations

import inspect
import logging
from typing import Any

from diffserve.executor.model.samplers import samples_with
from diffserve.executor.pipeline import built_from
from diffserve.wire.tasks import GENERATE, TASKS

log = logging.getLogger(__name__)


def takes_first_frame(pipe) -> bool:
    """A video pipeline conditioned on an input image (its first frame), not redrawing it."""
    params = inspect.signature(pipe.__call__).parameters
    return "num_frames" in params and "image" in params and "strength" not in params


def task_pipelines(pipe, family: type | None = None) -> dict[str, Any]:
    """Task name -> the pipeline that runs it: the loaded one for generation (unless its family
    only edits), for instruction edits (where the ``family`` conditions on reference images)
    and for rollouts (where the step engine knows the ``family`` and the rollout sampler the
    scheduler); and for image-to-image and inpainting, the pipeline the ``family`` names for the
    task (a model no family knows: diffusers' auto-pipeline of the loaded one), built from its
    own components (no second copy of the weights), where it redraws an input image by
    ``strength``. A model without a pipeline lacks the task."""
    import diffusers

    found: dict[str, Any] = {}
    if family.generates if family is not None else not takes_first_frame(pipe):
        found[GENERATE.name] = pipe
    for task in TASKS.values():
        if task.first_frame:
            if takes_first_frame(pipe):
                found[task.name] = pipe
            elif family is not None and family.first_frame_pipeline:
                found[task.name] = built_from(pipe, family.first_frame_pipeline)
                found[task.name].set_progress_bar_config(disable=True)
            continue
        if task.trajectory:
            if family is not None and family.generates and samples_with(pipe.scheduler):
                found[task.name] = pipe
            continue
        if task.references:
            if family is not None and family.max_references:
                found[task.name] = pipe
            continue
        # A family names its own (importing the auto-pipelines imports every pipeline they know).
        builder = (task.auto_pipeline if family is None
                   else family.strength_pipelines.get(task.name))
        if builder is None:
            continue
        try:
            built = (built_from(pipe, builder) if family is not None
                     else getattr(diffusers, builder).from_pipe(pipe))
        except (ValueError, KeyError, TypeError) as error:
            log.info("no %s pipeline for %s: %s", task.name, type(pipe).__name__, error)
            continue
        if "strength" not in inspect.signature(built.__call__).parameters:
            # e.g. FLUX.1 Kontext's and Qwen-Image-Edit's own pipelines stand in for their
            # image-to-image: they edit by instruction (the edit task), not by strength.
            log.info("no %s pipeline for %s: %s takes no strength", task.name,
                     type(pipe).__name__, type(built).__name__)
            continue
        built.set_progress_bar_config(disable=True)
        found[task.name] = built
    return found
