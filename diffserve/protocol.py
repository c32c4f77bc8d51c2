"""Every message that crosses a process boundary, in one place.

Wire format: a ZMQ multipart message. Frame 0 is one kind byte followed by a msgpack header (a
dataclass below); any further frames are raw pixel buffers (uint8), so pixels are never copied
into a header. Headers are decoded with validation against their dataclass: a malformed message
fails loudly at the boundary (:class:`ProtocolError`), never deep inside the scheduler.

:class:`ImageRequest` declares, per field, how the field takes part in batching (see
:mod:`diffserve.roles`). Each batching mode says which roles it can vary per sample; the batch
key is every other field. So the key follows the engine, and no list of field names exists
anywhere. The scheduler's queue computes a request's key once, when it enters, and the work item
carries it to the executor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgspec

from diffserve.costs import ABOVE_ONE
from diffserve.roles import (  # noqa: F401  (the roles are part of the protocol's vocabulary)
    BOOKKEEPING,
    CALL,
    REQUEST_MODE,
    ROLES,
    SAMPLE,
    SHAPE,
    STEP_MODE,
    VARIES_PER_SAMPLE,
    bookkeeping,
    call,
    fields_with_role,
    sample,
    shape,
    batch_key_fields,
)
from diffserve.tasks import GENERATE, Task, task_named
from diffserve.control import BASE_VERSION, WeightCommand, WeightResult, WeightStep

# Seeds are 32-bit, as the API accepts them; image i of a request uses (seed + i) modulo this.
SEED_MODULUS = 2**32

# How a work item ended.
FINISHED, FAILED, CANCELLED = "finished", "failed", "cancelled"
ITEM_OUTCOMES = (FINISHED, FAILED, CANCELLED)


@dataclass(frozen=True)
class ImageRequest:
    """A validated request (generation or edit) as the engine sees it."""

    request_id: str = bookkeeping()
    model: str = shape()
    width: int = shape()
    height: int = shape()
    # Instruction edits: how many reference images condition it. Their tokens lengthen every
    # row's sequence, so requests with different counts never share a forward.
    references: int = shape(0)
    task: str = call(GENERATE.name)  # a name in diffserve.tasks.TASKS
    num_inference_steps: int = call(20)
    guidance_scale: float = call(5.0)
    strength: float = call(1.0)  # edits: how far from the input image (1.0: ignore it)
    scheduler: str = call("")  # a sampler name (diffserve.executor.samplers); "": the model's own
    prompt: str = sample("")
    negative_prompt: str = sample("")
    seed: int = sample(0)
    n: int = sample(1)
    partial_images: int = sample(0)  # streamed previews per image (0-3)
    # LoRA adapters and their scales, in the order they apply. One stack per pipeline call in
    # request mode; the step engine applies each row's own stack within one forward.
    loras: tuple[tuple[str, float], ...] = call(())
    # What one image costs a forward (see diffserve.costs), priced by the frontend.
    cost: float = bookkeeping(1.0)
    # Its priority class (lower runs sooner; diffserve.policies.priority): it orders the queue
    # and decides preemption, never what is computed.
    priority: int = bookkeeping(0)
    # Rollouts: the stochastic sampler's noise level (0: the deterministic sampler), and which
    # tensors come back (diffserve.rollouts.RETURNABLE).
    noise_level: float = call(0.0)
    returns: tuple[str, ...] = sample(())
    # Videos: the frame count (0: an image), and the low-noise expert's guidance scale of a
    # two-expert model (None: guidance_scale).
    num_frames: int = shape(0)
    guidance_scale_2: float | None = call(None)
    progress: bool = sample(False)  # the executor reports its steps done (Kind.PROGRESS)
    # The step cache's threshold (diffserve.executor.step_cache): 0 never reuses; None takes
    # the server's --cache-threshold. Each request decides with its own in a running set.
    cache_threshold: float | None = call(None)

    def batch_key(self, mode: str) -> tuple:
        """What another request must share with this one to run in the same batch (request mode)
        or running set (step mode)."""
        return tuple(getattr(self, name) for name in batch_key_fields(type(self), mode))

    @property
    def task_spec(self) -> Task:
        return task_named(self.task)

    @property
    def input_frames(self) -> int:
        task = self.task_spec
        return len(task.inputs) + (self.references if task.references else 0)

    def seed_of(self, index: int) -> int:
        """The seed of image ``index``: consecutive from the request's seed, wrapping at 2**32."""
        return (self.seed + index) % SEED_MODULUS


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
    """Images ``start``..``stop-1`` of one request, handed to an executor. Its input frames (if
    the request is an edit) follow the header, item after item."""

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


@dataclass(frozen=True)
class Work:
    """Scheduler to executor. Request mode: one pipeline call over every item. Step mode: items
    that join the running set at the next step boundary."""

    work_id: int
    items: list[WorkItem]


@dataclass(frozen=True)
class ItemResult:
    """How one work item ended. A finished item's images went to the frontend beforehand."""

    request_id: str
    start: int
    stop: int
    status: str  # one of ITEM_OUTCOMES
    execution_s: float  # pipeline time this item took part in (request mode: the whole call)
    error: str | None = None
    prompt_tokens: int = 0
    cached_steps: list[int] | None = None  # per image, steps that reused its step cache
    code: str | None = None  # a failure's error code for the client (e.g. non_finite_output)


@dataclass(frozen=True)
class ItemsDone:
    """Executor to scheduler: items that ended (request mode: a whole call; step mode: the
    requests retired at one step). Headers only: the pixels go straight to the frontend."""

    items: list[ItemResult]


@dataclass(frozen=True)
class ItemImages:
    """Executor to frontend: images ``start``..``stop-1`` of a request, one raw frame each
    (uint8, height x width x 3), sent before the item's result goes to the scheduler."""

    request_id: str
    start: int
    stop: int
    width: int
    height: int
    frames: int = 0  # videos: each frame holds this many images, frame after frame (0: one image)


@dataclass(frozen=True)
class Progress:
    """Executor to frontend: a request's denoising steps done of its total (rate-limited)."""

    request_id: str
    done: int
    total: int


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name
    shape: list[int]


@dataclass(frozen=True)
class ItemTensors:
    """Executor to frontend: a rollout's tensors for images ``start``..``stop-1`` (each tensor's
    first axis), one raw frame per tensor, sent before the item's result goes to the scheduler."""

    request_id: str
    start: int
    stop: int
    tensors: list[TensorSpec]


@dataclass(frozen=True)
class Partial:
    """Executor to frontend: a streamed preview, image ``index`` of a request after some of its
    steps. One frame."""

    request_id: str
    index: int
    partial_index: int
    width: int
    height: int


@dataclass(frozen=True)
class Pause:
    """Scheduler to executor: take these items (request id, first image) out of the running set
    at the next step boundary and keep their state until they are sent again with ``resume``."""

    items: list[tuple[str, int]]

    def __post_init__(self) -> None:
        object.__setattr__(self, "items", [tuple(key) for key in self.items])


@dataclass(frozen=True)
class Cancel:
    """Scheduler to executor: these requests' callers have gone; drop their work."""

    request_ids: list[str]


@dataclass(frozen=True)
class Component:
    """A pipeline component where it sits: its name, device, the rank of a parallel group that
    holds it (0 without one), its dtype and the bytes its weights take there."""

    name: str
    device: str
    rank: int
    dtype: str
    bytes: int


@dataclass(frozen=True)
class ModelInfo:
    """What the frontend needs to validate requests against the loaded model."""

    name: str
    pipeline_class: str
    width: int
    height: int
    spatial_stride: int
    default_steps: int
    max_steps: int  # the noise scheduler's limit (its training timesteps)
    default_guidance_scale: float
    supports_negative_prompt: bool
    device: str
    dtype: str
    batching_mode: str
    tasks: list[str]  # names in diffserve.tasks.TASKS: the tasks served
    partial_images: bool  # whether streamed previews are real intermediate decodes
    family: str | None = None  # the step engine's family, where it knows the pipeline
    # When classifier-free guidance runs (diffserve.costs.GUIDANCE_RULES): the frontend prices
    # requests by it without knowing the families.
    guidance_rule: str = ABOVE_ONE
    adapters: list[str] = field(default_factory=list)  # LoRA adapters served at start
    max_edit_images: int = 0  # the most input images one edit takes (0: no edits)
    schedulers: list[str] = field(default_factory=list)  # sampler names a request may pick
    # Admission by cost (diffserve.costs): the bounds with their defaults resolved for this model.
    max_batch_cost: float = 0.0
    max_running_cost: float = 0.0
    # Admission by memory (diffserve.executor.memory_budget), where a budget is set: the budget,
    # the cost it allows, and what the executor holds and a unit of cost takes.
    memory_budget_bytes: int = 0
    memory_cost_bound: float = 0.0
    memory_held_bytes: int = 0
    memory_per_cost_bytes: float = 0.0
    # Videos (0 for image models): the native frame count, the VAE's temporal stride (a frame
    # count is stride x k + 1) and the frame rate a video is encoded at by default.
    num_frames: int = 0
    frame_stride: int = 1
    fps: int = 0
    guidance_scale_2: bool = False  # a two-expert model takes guidance_scale_2
    step_cache: bool = False  # the engine runs a step cache (requests may set cache_threshold)
    # Each task's batching mode (a task the step engine gets wrong runs in request mode), and the
    # tasks the model has but cannot serve, with why (their plain pipeline fails on it).
    task_modes: dict[str, str] = field(default_factory=dict)
    unavailable_tasks: dict[str, str] = field(default_factory=dict)
    # Each executor's parallel group ({"ulysses", "ring", "cfg", "tp", "groups"}) and where its
    # components sit (one executor's view).
    parallel: dict[str, int] = field(default_factory=dict)
    components: list[Component] = field(default_factory=list)

    def mode_of(self, task: str) -> str:
        return self.task_modes.get(task, self.batching_mode)


@dataclass(frozen=True)
class AdapterCommand:
    """Frontend -> scheduler -> every executor: load (or replace) or unload a LoRA adapter."""

    command_id: str
    op: str  # LOAD or UNLOAD
    name: str
    path: str = ""


LOAD, UNLOAD = "load", "unload"


@dataclass(frozen=True)
class AdapterResult:
    """Executor -> scheduler -> frontend: how an AdapterCommand went (``status`` is the HTTP one:
    400 for a file that is not a LoRA of this model, 404 for an unknown name)."""

    command_id: str
    status: int = 200
    error: str = ""


@dataclass(frozen=True)
class AdapterSync:
    """Scheduler -> executor: every adapter the server serves now (name -> path), for an
    executor that (re)started to catch up with runtime loads and unloads."""

    adapters: dict[str, str]


@dataclass(frozen=True)
class ExecutorState:
    index: int
    state: str  # starting | ready | restarting | failed
    device: str
    pid: int | None = None
    restarts: int = 0


@dataclass(frozen=True)
class EngineStatus:
    """Scheduler to frontend: the executors' states (ready while at least one is), the weights'
    version and whether the server sleeps (its level; 0: awake)."""

    executors: list[ExecutorState]
    weight_version: str = BASE_VERSION
    sleeping: int = 0

    @property
    def ready(self) -> bool:
        return any(e.state == "ready" for e in self.executors)


@dataclass(frozen=True)
class RequestDone:
    """Scheduler to frontend: every image of the request is made (the pixels came from the
    executors as :class:`ItemImages`)."""

    request_id: str
    seeds: list[int]
    prompt_tokens: int = 0
    cached_steps: list[int] | None = None  # per image, where the request ran with a step cache
    weight_version: str = BASE_VERSION  # the weights that made it


@dataclass(frozen=True)
class RequestFailed:
    request_id: str
    status: int
    message: str
    type: str = "server_error"
    code: str | None = None


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Fatal:
    """A process could not start (e.g. the model failed to load); the server cannot serve."""

    message: str


@dataclass(frozen=True)
class Empty:
    """Messages that carry nothing but their kind."""


class Kind(enum.IntEnum):
    """The one-byte message kind, and what each kind carries."""

    SUBMIT = 1          # frontend -> scheduler: ImageRequest + input frames
    ABORT = 2           # frontend -> scheduler: Abort
    READY = 3           # executor -> scheduler -> frontend: ModelInfo
    REQUEST_DONE = 4    # scheduler -> frontend: RequestDone
    REQUEST_FAILED = 5  # scheduler -> frontend: RequestFailed
    ENGINE_STATUS = 6   # scheduler -> frontend: EngineStatus
    WORK = 7            # scheduler -> executor: Work + input frames
    ITEMS_DONE = 8      # executor -> scheduler: ItemsDone
    SHUTDOWN = 9        # parent -> child: Empty
    FATAL = 10          # child -> parent: Fatal
    CANCEL = 11         # scheduler -> executor: Cancel
    PARTIAL = 12        # executor -> frontend: Partial + one frame
    DRAIN = 13          # frontend -> scheduler: Empty; stop waiting for company, the server stops
    IMAGES = 14         # executor -> frontend: ItemImages + one frame per image
    ADAPTER = 15        # frontend -> scheduler -> executors: AdapterCommand
    ADAPTER_DONE = 16   # executor -> scheduler -> frontend: AdapterResult
    ADAPTER_SYNC = 17   # scheduler -> executor: AdapterSync
    TENSORS = 18        # executor -> frontend: ItemTensors + one frame per tensor
    PROGRESS = 20       # executor -> frontend: Progress
    PAUSE = 19          # scheduler -> executor: Pause
    WEIGHTS = 21        # frontend -> scheduler: WeightCommand
    WEIGHT_STEP = 22    # scheduler -> executor: WeightStep
    WEIGHTS_DONE = 23   # executor -> scheduler -> frontend: WeightResult


PAYLOADS: dict[Kind, type] = {
    Kind.SUBMIT: ImageRequest, Kind.ABORT: Abort, Kind.READY: ModelInfo,
    Kind.REQUEST_DONE: RequestDone, Kind.REQUEST_FAILED: RequestFailed,
    Kind.ENGINE_STATUS: EngineStatus, Kind.WORK: Work, Kind.ITEMS_DONE: ItemsDone,
    Kind.SHUTDOWN: Empty, Kind.FATAL: Fatal, Kind.CANCEL: Cancel, Kind.PARTIAL: Partial,
    Kind.DRAIN: Empty, Kind.IMAGES: ItemImages, Kind.ADAPTER: AdapterCommand,
    Kind.ADAPTER_DONE: AdapterResult, Kind.ADAPTER_SYNC: AdapterSync, Kind.TENSORS: ItemTensors,
    Kind.PROGRESS: Progress,
    Kind.PAUSE: Pause,
    Kind.WEIGHTS: WeightCommand, Kind.WEIGHT_STEP: WeightStep, Kind.WEIGHTS_DONE: WeightResult,
}

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in PAYLOADS.items()}


class ProtocolError(ValueError):
    """A message that is not what its kind says it is."""


def encode(kind: Kind, message: Any = None, buffers: Sequence[Any] = ()) -> list[Any]:
    """Frames for ``socket.send_multipart``; ``buffers`` go as-is (bytes, memoryview, zmq.Frame)."""
    payload = Empty() if message is None else message
    if type(payload) is not PAYLOADS[kind]:
        raise ProtocolError(f"a {kind.name} message carries {PAYLOADS[kind].__name__}, "
                            f"not {type(payload).__name__}")
    return [bytes((kind,)) + _ENCODER.encode(payload), *buffers]


def decode(frames: Sequence[Any]) -> tuple[Kind, Any, list[Any]]:
    """Inverse of :func:`encode`: (kind, message, raw buffer frames)."""
    if not frames:
        raise ProtocolError("empty message")
    head = frames[0]
    head = head.bytes if hasattr(head, "bytes") else bytes(head)
    try:
        kind = Kind(head[0])
    except (IndexError, ValueError):
        raise ProtocolError(f"unknown message kind {head[:1]!r}") from None
    try:
        message = _DECODERS[kind].decode(head[1:])
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise ProtocolError(f"malformed {kind.name} message: {error}") from None
    return kind, message, list(frames[1:])
