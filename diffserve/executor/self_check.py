"""The start-up checks on the loaded model, before any client is served.

- **The step engine**: for every task the model serves (rollouts aside, which no pipeline call
  samples), one two-step request at a small size through the step engine and through the plain
  pipeline (request mode's one call), compared within 2/255. A family or scheduler the step
  engine gets wrong (a swapped scheduler it does not handle, a pipeline version that changed a
  helper) shows here.
- **The samplers** a request may pick: each offered one runs a two-step request, so that the
  model lists only those that work on it.
"""

from __future__ import annotations

import logging

import numpy as np

from diffserve.protocol import STEP_MODE, ImageRequest, Work, WorkItem
from diffserve.tasks import TASKS

log = logging.getLogger(__name__)

TOLERANCE = 2  # per pixel, of 255: batching's float effects stay well within it
SIDE = 64  # pixels; rounded up to the model's stride, at most its native size
STEPS = 2
SAMPLER_STEPS = 4  # PNDM, for one, cannot take fewer (in diffusers itself)


def check(rt) -> str | None:
    """What differs between the step engine and the plain pipeline on ``rt``'s model (the first
    task that does, and how), or None."""
    requests = [_request(rt, name) for name in rt.pipelines if not TASKS[name].trajectory]
    for request, (stepped, plain) in zip(requests, _run(rt, requests, step=True)):
        for what, o in (("the step engine", stepped), ("the plain pipeline", plain)):
            if o.error:
                return f"{request.task}: {what} failed: {o.error}"
        diff = _diff(stepped, plain)
        if diff > TOLERANCE:
            return (f"{request.task}: the step engine's image differs from the plain pipeline's "
                    f"by {diff}/255 (at most {TOLERANCE} expected)")
    return None


def samplers(rt, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The samplers of ``names`` that work on ``rt``'s model in its mode (a two-step request
    each: the plain pipeline runs it, and in step mode the step engine matches it), and why each
    other one does not. A scheduler diffusers calls compatible may still not take the model's
    config (a flow-prediction model under DDIM, say)."""
    task = next(name for name in rt.pipelines if not TASKS[name].trajectory)
    requests = [_request(rt, task, scheduler=name, steps=SAMPLER_STEPS) for name in names]
    working, why = [], {}
    for request, (stepped, plain) in zip(requests, _run(rt, requests, rt.mode == STEP_MODE)):
        failed = next((o.error for o in (plain, stepped) if o is not None and o.error), None)
        if failed is not None:
            why[request.scheduler] = failed
        elif stepped is not None and _diff(stepped, plain) > TOLERANCE:
            why[request.scheduler] = f"the step engine differs by {_diff(stepped, plain)}/255"
        else:
            working.append(request.scheduler)
    return working, why


def _request(rt, task_name: str, scheduler: str = "", steps: int = STEPS) -> ImageRequest:
    """A short request of ``task_name`` at a small size (at most the native one)."""
    info, task = rt.info, TASKS[task_name]
    stride = info.spatial_stride
    width, height = (min(native, max(stride, -(-SIDE // stride) * stride))
                     for native in (info.width, info.height))
    return ImageRequest(
        f"startup-check-{task_name}-{scheduler}", info.name, width, height,
        references=1 if task.references else 0, task=task_name, num_inference_steps=steps,
        guidance_scale=info.default_guidance_scale, strength=0.5 if task.from_image else 1.0,
        scheduler=scheduler, prompt="a start-up check of the step engine", seed=1,
        # A video model's shortest video past one frame: the temporal layers take part.
        num_frames=min(info.num_frames, info.frame_stride + 1) if info.num_frames else 0)


def _run(rt, requests: list[ImageRequest], step: bool):
    """Each request's outcome in the step engine (None unless ``step``: all of them together,
    as they would share its forwards) and alone through the plain pipeline."""
    items = [WorkItem(r, 0, 1) for r in requests]
    inputs = [_frames(r) for r in requests]
    stepped: dict[str, object] = {}
    if step:
        engine = rt.step_engine()
        outcomes = engine.admit(items, inputs)
        while engine:
            outcomes += engine.step().finished
        stepped = {o.item.request.request_id: o for o in outcomes}
    runner = rt.request_runner()
    for item, frames in zip(items, inputs):
        (plain,) = runner.execute(Work(0, [item]), [frames])
        yield stepped.get(item.request.request_id), plain


def _diff(a, b) -> int:
    return int(np.abs(a.images.astype(int) - b.images.astype(int)).max())


def _frames(request: ImageRequest) -> list[np.ndarray]:
    """Input images with some structure (a gradient and a block), and a mask of the right half."""
    h, w = request.height, request.width
    ramp = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    image = np.broadcast_to(ramp, (h, w, 3)).astype(np.uint8).copy()
    image[h // 4:3 * h // 4, w // 4:3 * w // 4] = (200, 40, 30)
    frames = []
    for spec in request.task_spec.inputs:
        if spec.channels == 1:
            mask = np.zeros((h, w), np.uint8)
            mask[:, w // 2:] = 255
            frames.append(mask)
        else:
            frames.append(image)
    return frames + [image] * request.references
