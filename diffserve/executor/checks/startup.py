"""The start-up checks on the loaded model, before any client is served. Each decides per task.

- **The plain pipeline** of every task the model has (rollouts aside, which no pipeline call
  samples) runs one two-step request at a small size. A task whose pipeline cannot run on this
  model (diffusers' SD3 inpainting refuses a 4-channel transformer, say) is not offered: it says
  nothing about the engines, the task simply cannot be served. This runs in both batching modes.
- **The step engine**, in step mode, runs the same requests together and each image is compared
  with the plain pipeline's. In float32 they must agree within 2/255. In half precision the
  plain pipeline is itself some way from what the model computes in float32 (and kernels change
  with the batch size), so the plain pipeline also runs once in float32
  (:mod:`~diffserve.executor.checks.float32`) and the step engine's image may be no further
  from that one, on average per pixel, than the half-precision plain pipeline's is, plus a
  margin (:data:`HALF_MARGIN`, :data:`HALF_SLACK`). A task whose image differs (or whose stage
  raises) falls back to request mode alone; the other tasks keep the step engine. A family or
  scheduler the step engine gets wrong (a swapped scheduler it does not handle, a pipeline
  version that changed a helper) shows here.
- **The samplers** a request may pick: each offered one runs a short request, so that the
  model lists only those that work on it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from diffserve.executor.checks import float32
from diffserve.executor.results import FAILURE
from diffserve.policies.base import SetPolicy
from diffserve.wire.protocol import STEP_MODE
from diffserve.wire.request import WITH_CONTROLS, Control, ImageRequest, Work, WorkItem
from diffserve.wire.tasks import TASKS

log = logging.getLogger(__name__)

TOLERANCE = 2  # per pixel, of 255: batching's float effects stay well within it
# Half precision: the step engine's mean distance to the float32 image may exceed the plain
# half-precision pipeline's by this share of it, plus this many 255ths. Measured on the tiny SD,
# Flux and Qwen-Image in bfloat16 (docs/batching.md): the step engine's image-to-image was up to
# 1.2x as far as the plain pipeline's (0.88 against 0.73 on Flux), every other task within 1.02x.
HALF_SLACK = 0.25
HALF_MARGIN = 0.5
SIDE = 64  # pixels; rounded up to the model's stride, at most its native size
STEPS = 2
SAMPLER_STEPS = 4  # PNDM, for one, cannot take fewer (in diffusers itself)


@dataclass
class TaskVerdicts:
    """What the checks found, per task: ``unavailable``, the tasks whose plain pipeline cannot
    run on the model (not offered); ``fallback``, the tasks the step engine gets wrong (served
    in request mode). Each maps the task to why."""

    unavailable: dict[str, str] = field(default_factory=dict)
    fallback: dict[str, str] = field(default_factory=dict)


def checked_tasks(rt) -> list[str]:
    """The tasks a pipeline call can check (every one but rollouts)."""
    return [name for name in rt.pipelines if not TASKS[name].trajectory]


def check(rt, where: str = float32.DEVICE) -> TaskVerdicts:
    """Each task's plain pipeline on ``rt``'s model and, in step mode, the step engine against
    it; with control models served, each task with every one of them stacked as well (its
    diffusers ControlNet pipeline against the step engine), as a mode key of its own.
    ``where``: where a half-precision model's float32 reference runs
    (:func:`~diffserve.executor.checks.float32.place`)."""
    verdicts = TaskVerdicts()
    requests = {name: _request(rt, name) for name in checked_tasks(rt)}
    if rt.controls:
        controls = tuple(Control(m.name, mode=0 if m.modes else None)
                         for m in rt.controls.models.values())
        for name in checked_tasks(rt):
            if name in rt.family.control_pipelines:
                requests[name + WITH_CONTROLS] = _request(rt, name, controls=controls)
            else:
                verdicts.unavailable[name + WITH_CONTROLS] = (
                    f"diffusers has no ControlNet pipeline for {name} with {rt.family.name}")
    plain = {key: _plain(rt, request) for key, request in requests.items()}
    for key, outcome in plain.items():
        if outcome.error:
            verdicts.unavailable[key] = f"its plain pipeline failed: {_cause(outcome)}"
    if rt.mode != STEP_MODE:
        return verdicts
    served = [request for key, request in requests.items() if key not in verdicts.unavailable]
    judge = _judge(rt, served, where)
    for request, stepped in zip(served, _stepped(rt, served)):
        why = judge(request, stepped, plain[request.mode_key])
        if why is not None:
            verdicts.fallback[request.mode_key] = why
    return verdicts


def _judge(rt, requests: list[ImageRequest], where: str):
    """``judge(request, stepped, plain)``: why the step engine's outcome is not the plain
    pipeline's, or None; by the rule of the served dtype (see the module's docstring)."""
    if rt.loaded.dtype == "float32":
        return lambda request, stepped, plain: _mismatch(stepped, plain)
    reference = float32.run(rt, requests, _plain, where)

    def judge(request, stepped, plain):
        if stepped.error or reference is None:  # no reference: only a failure is judged
            return _mismatch(stepped, plain) if stepped.error else None
        exact = reference[request.request_id]
        if exact.error:  # e.g. weights that cannot compute in float32: nothing to judge by
            return f"the float32 reference it is judged by failed: {_cause(exact)}"
        step_off, plain_off = _mean_diff(stepped, exact), _mean_diff(plain, exact)
        allowed = plain_off * (1 + HALF_SLACK) + HALF_MARGIN
        if step_off > allowed:
            return (f"in {rt.loaded.dtype} the step engine's image is {step_off:.2f}/255 from the "
                    f"float32 image on average, the plain pipeline's {plain_off:.2f}/255 (at most "
                    f"{allowed:.2f} expected)")
        return None

    return judge


def _mismatch(stepped, plain) -> str | None:
    """Why the step engine's outcome is not the plain pipeline's (float32's rule), or None."""
    if stepped.error:
        return f"the step engine failed: {_cause(stepped)}"
    diff = _diff(stepped, plain)
    if diff > TOLERANCE:
        return (f"the step engine's image differs from the plain pipeline's by {diff}/255 (at "
                f"most {TOLERANCE} expected)")
    return None


def samplers(rt, names: list[str], task: str, step: bool,
             where: str = float32.DEVICE) -> tuple[list[str], dict[str, str]]:
    """The samplers of ``names`` that work on ``rt``'s model for ``task`` (a short request each:
    the plain pipeline runs it, and where ``step`` the step engine matches it; in half precision
    both run in float32 for this), and why each other one does not. A scheduler diffusers calls compatible may
    still not take the model's config (a flow-prediction model under DDIM, say)."""
    if rt.loaded.dtype != "float32" and where == float32.SKIP:  # no room for float32
        return _samplers(rt, names, task, step, judge=lambda request, stepped, plain: None)
    if rt.loaded.dtype != "float32":
        # Whether the step engine runs a sampler as diffusers does is a question of its code, not
        # of the dtype: answered in float32, by float32's rule.
        with float32.reference(rt, None if where == float32.DEVICE else "cpu"):
            return _samplers(rt, names, task, step, judge=lambda request, stepped, plain:
                             _mismatch(stepped, plain))
    return _samplers(rt, names, task, step)


def _samplers(rt, names: list[str], task: str, step: bool, judge=None):
    requests = [_request(rt, task, scheduler=name, steps=SAMPLER_STEPS) for name in names]
    plain = [_plain(rt, request) for request in requests]
    working, why = [], {}
    runs = [r for r, o in zip(requests, plain) if not o.error]
    judged = dict(zip(runs, _stepped(rt, runs))) if step and runs else {}
    judge = judge or (_judge(rt, runs, float32.DEVICE) if judged else None)
    for request, outcome in zip(requests, plain):
        failed = outcome.error or (judged[request].error if request in judged else None)
        if failed:
            why[request.scheduler] = _cause_of(failed)
        elif request in judged and (reason := judge(request, judged[request], outcome)):
            why[request.scheduler] = reason
        else:
            working.append(request.scheduler)
    return working, why


def _request(rt, task_name: str, scheduler: str = "", steps: int = STEPS,
             controls: tuple = ()) -> ImageRequest:
    """A short request of ``task_name`` at a small size (at most the native one)."""
    info, task = rt.info, TASKS[task_name]
    stride = info.spatial_stride
    width, height = (min(native, max(stride, -(-SIDE // stride) * stride))
                     for native in (info.width, info.height))
    return ImageRequest(
        f"startup-check-{task_name}{WITH_CONTROLS if controls else ''}-{scheduler}", info.name,
        width, height, controls=controls,
        references=1 if task.references else 0, task=task_name, num_inference_steps=steps,
        guidance_scale=info.default_guidance_scale, strength=0.5 if task.from_image else 1.0,
        scheduler=scheduler, prompt="a start-up check of the step engine", seed=1,
        # A video model's shortest video past one frame: the temporal layers take part.
        num_frames=min(info.num_frames, info.frame_stride + 1) if info.num_frames else 0)


class _InOrder(SetPolicy):
    """The checks' set choice: by batch key, whatever the clock. The ranks of a parallel group
    each run the checks and must take the same steps."""

    name = "in-order"

    def choose(self, sets, now):
        return min(sets, key=repr)


def _stepped(rt, requests: list[ImageRequest]) -> list:
    """Each request's outcome in the step engine, all of them together, as they would share its
    forwards."""
    # Inline stages and no prompt cache: the checks' encodings (float32 ones among them, in half
    # precision) are not kept for the requests that follow.
    engine = rt.step_engine(policy=_InOrder(), stages=False, prompt_cache=None)
    outcomes = engine.admit([WorkItem(r, 0, 1) for r in requests], [_frames(r) for r in requests])
    while engine:
        outcomes += engine.step().finished
    by_id = {o.item.request.request_id: o for o in outcomes}
    return [by_id[r.request_id] for r in requests]


def _plain(rt, request: ImageRequest):
    """The request's outcome alone through its task's plain pipeline (request mode's call)."""
    (outcome,) = rt.request_runner().execute(Work(0, [WorkItem(request, 0, 1)]), [_frames(request)])
    return outcome


def _cause(outcome) -> str:
    """A failed outcome's error, without the prefix a client's answer has."""
    return _cause_of(outcome.error)


def _cause_of(error: str) -> str:
    return error.removeprefix(FAILURE)


def _mean_diff(a, b) -> float:
    return float(np.abs(a.images.astype(float) - b.images.astype(float)).mean())


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
    return frames + [image] * (request.references + len(request.controls))
