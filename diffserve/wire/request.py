"""A request as the engine sees it (:class:`ImageRequest`), and the work an executor is handed
(:class:`WorkItem`, :class:`Work`).

:class:`ImageRequest` declares, per field, how the field takes part in batching (see
:mod:`diffserve.wire.roles`). Each batching mode says which roles it can vary per sample; the batch
key is every other field. So the key follows the engine, and no list of field names exists
anywhere. The scheduler's queue computes a request's key once, when it enters, and the work item
carries it to the executor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from diffserve.wire.roles import batch_key_fields, bookkeeping, call, sample, shape, size
from diffserve.wire.tasks import GENERATE, REFERENCE, Input, Task, task_named

# Seeds are unsigned 32-bit: the API accepts 0..SEED_MAX, and image i of a request uses
# (seed + i) modulo SEED_MODULUS.
SEED_MODULUS = 2**32
SEED_MAX = SEED_MODULUS - 1
# The step count of a request that gives none, where neither the model's serving defaults
# (its diffserve.json) nor its pipeline's call signature name one. Every embedded model and every
# diffusers pipeline names its own, so this is the last resort, and the dataclass default of a
# request built in code.
DEFAULT_STEPS = 30
# A request's mode key names its task, and that it carries controls (their start-up check and
# batching mode are their own: diffserve.executor.checks).
WITH_CONTROLS = "+controls"


@dataclass(frozen=True)
class Control:
    """One control a request stacks (ControlNet): the served control model by name, its scale,
    the part of the denoising it acts in (fractions of the request's steps, as diffusers'
    control_guidance_start and end) and, for a union model, the control type. Its image travels
    as the input frame its request's manifest lists as ``controls[c]`` (c: its place in the
    stack), fitted to the request's size."""

    model: str
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    mode: int | None = None

    def acts_at(self, step: int, steps: int) -> bool:
        """Whether it acts at ``step`` of ``steps``: diffusers' rule (``controlnet_keep``)."""
        return not (step / steps < self.start or (step + 1) / steps > self.end)


# The roles of a request's input frames besides its task's inputs (whose role is their pipeline
# keyword): an instruction edit's reference images, and the controls' images.
REFERENCES, CONTROLS = REFERENCE.name, "controls"


@dataclass(frozen=True)
class FrameSpec:
    """One input frame after a request's header: what it is for (``role``: a task input's
    pipeline keyword, :data:`REFERENCES` or :data:`CONTROLS`), whose it is (``owner``: which
    reference, or which of the request's controls; 0 for a task input), and its array's shape
    and dtype. A control and its image are paired by this entry, wherever the frame lies."""

    role: str
    owner: int
    shape: tuple[int, ...]
    dtype: str = "uint8"

    @property
    def nbytes(self) -> int:
        size = 1
        for side in self.shape:
            size *= side
        return size  # uint8 (a request's manifest is checked against frame_manifest's)


def frame_manifest(task: Task, width: int, height: int, references: int = 0,
                   controls: int = 0) -> tuple[FrameSpec, ...]:
    """The frames a request carries, in the order they are sent: its task's inputs, an
    edit's references, then each control's image (all at the request's size)."""
    def entry(spec: Input, owner: int, role: str | None = None) -> FrameSpec:
        return FrameSpec(role or spec.name, owner, spec.shape(width, height))

    return (*(entry(spec, 0) for spec in task.inputs),
            *(entry(REFERENCE, i) for i in range(references if task.references else 0)),
            *(entry(REFERENCE, c, CONTROLS) for c in range(controls)))


def in_manifest_order(manifest: Sequence[FrameSpec],
                      by_role: dict[str, Sequence[Any]]) -> list:
    """The frames to send after a header with ``manifest``: each entry's from ``by_role``
    (role -> its frames by owner)."""
    return [by_role[spec.role][spec.owner] for spec in manifest]


@dataclass(frozen=True)
class ImageRequest:
    """A validated request (generation or edit) as the engine sees it."""

    request_id: str = bookkeeping()
    model: str = shape()
    # Its size: one per forward, except where the step engine mixes sizes (the rows' tokens
    # padded to the longest: diffserve.executor.families.row_sizes).
    width: int = size()
    height: int = size()
    # Instruction edits: how many reference images condition it. Their tokens lengthen every
    # row's sequence, so requests with different counts never share a forward.
    references: int = shape(0)
    task: str = call(GENERATE.name)  # a name in diffserve.wire.tasks.TASKS
    num_inference_steps: int = call(DEFAULT_STEPS)
    guidance_scale: float = call(5.0)
    strength: float = call(1.0)  # edits: how far from the input image (1.0: ignore it)
    scheduler: str = call("")  # a sampler name (diffserve.executor.model.samplers); "": the model's own
    prompt: str = sample("")
    negative_prompt: str = sample("")
    seed: int = sample(0)
    n: int = sample(1)
    partial_images: int = sample(0)  # streamed previews per image (0-3)
    # LoRA adapters and their scales, in the order they apply. One stack per pipeline call in
    # request mode; the step engine applies each row's own stack within one forward.
    loras: tuple[tuple[str, float], ...] = call(())
    # What one image costs a forward (see diffserve.wire.costs), priced by the frontend.
    cost: float = bookkeeping(1.0)
    # Its priority class (lower runs sooner; diffserve.policies.priority): it orders the queue
    # and decides preemption, never what is computed.
    priority: int = bookkeeping(0)
    # Rollouts: the stochastic sampler's noise level (0: the deterministic sampler), and which
    # tensors come back (diffserve.wire.rollouts.RETURNABLE).
    noise_level: float = call(0.0)
    returns: tuple[str, ...] = sample(())
    # Videos: the frame count (0: an image; a size: Wan mixes frame counts in one forward), and
    # the low-noise expert's guidance scale of a two-expert model (None: guidance_scale).
    num_frames: int = size(0)
    guidance_scale_2: float | None = call(None)
    progress: bool = sample(False)  # the executor reports its steps done (Kind.PROGRESS)
    # The step cache's threshold (diffserve.executor.accel.step_cache): 0 never reuses; None takes
    # the server's --cache-threshold. Each request decides with its own in a running set.
    cache_threshold: float | None = call(None)
    # ControlNet controls, stacked (their residuals summed, each scaled in its own window). One
    # stack per pipeline call in request mode; per row in the step engine.
    controls: tuple[Control, ...] = call(())
    # Its input frames, as they follow its header (see FrameSpec); left empty, the layout
    # frame_manifest gives. Any order, but exactly the frames the request needs.
    manifest: tuple[FrameSpec, ...] = bookkeeping(())

    def __post_init__(self) -> None:
        needed = frame_manifest(self.task_spec, self.width, self.height, self.references,
                                len(self.controls))
        if not self.manifest:
            object.__setattr__(self, "manifest", needed)
        elif sorted(self.manifest, key=_order) != sorted(needed, key=_order):
            raise ValueError(f"request {self.request_id!r}: its frame manifest "
                             f"{_listed(self.manifest)} is not the frames it needs "
                             f"({_listed(needed)})")

    def batch_key(self, mode: str) -> tuple:
        """What another request must share with this one to run in the same batch (request mode)
        or running set (step mode)."""
        return tuple(getattr(self, name) for name in batch_key_fields(type(self), mode))

    @property
    def task_spec(self) -> Task:
        return task_named(self.task)

    @property
    def input_frames(self) -> int:
        """Frames after the header: the task's inputs, an edit's references, a control image
        for each control."""
        return len(self.manifest)

    @property
    def mode_key(self) -> str:
        """What decides its batching mode: its task, and whether it carries controls."""
        return self.task + (WITH_CONTROLS if self.controls else "")

    def seed_of(self, index: int) -> int:
        """The seed of image ``index``: consecutive from the request's seed, wrapping at 2**32."""
        return (self.seed + index) % SEED_MODULUS


def _order(spec: FrameSpec) -> tuple:
    return (spec.role, spec.owner, tuple(spec.shape), spec.dtype)


def _listed(manifest: Sequence[FrameSpec]) -> str:
    return "[" + ", ".join(f"{s.role}[{s.owner}] {'x'.join(map(str, s.shape))}"
                           for s in manifest) + "]"


def repeated_adapter(loras: Sequence[tuple[str, float]]) -> str | None:
    """The rule of a LoRA stack: it names each adapter once (one scale each). The first name it
    repeats, if any."""
    seen: set[str] = set()
    for name, _ in loras:
        if name in seen:
            return name
        seen.add(name)
    return None


def _frozen(value: Any) -> Any:
    return tuple(map(_frozen, value)) if isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class WorkItem:
    """Images ``start``..``stop-1`` of one request, handed to an executor. Its input frames (its
    request's manifest) follow the header, item after item; a resumed item carries none (its
    executor holds its state)."""

    request: ImageRequest
    start: int
    stop: int
    # How long the request had waited in the scheduler's queue when this item left it: the
    # step engine counts a request's time from its arrival (diffserve.policies).
    queued_s: float = 0.0
    # The request's batch key in the server's batching mode, computed once by the queue (empty
    # where the item did not come through one: the engine computes it once at admission).
    batch_key: tuple = ()
    # A paused item going back into its executor's running set (that executor holds its state;
    # if it finished the item before the pause reached it, it drops this).
    resume: bool = False

    def __post_init__(self) -> None:
        # msgpack has no tuples: nested ones (a LoRA stack in a request-mode key) come back as
        # lists, which a key, being hashed, cannot hold.
        object.__setattr__(self, "batch_key", _frozen(self.batch_key))

    @property
    def key(self) -> tuple[str, int]:
        return (self.request.request_id, self.start)

    @property
    def samples(self) -> int:
        return self.stop - self.start

    @property
    def manifest(self) -> tuple[FrameSpec, ...]:
        """The input frames that travel with it."""
        return () if self.resume else self.request.manifest


@dataclass(frozen=True)
class Work:
    """Scheduler to executor. Request mode: one pipeline call over every item. Step mode: items
    that join the running set at the next step boundary."""

    work_id: int
    items: list[WorkItem]
