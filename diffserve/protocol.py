"""Every message that crosses a process boundary, in one place.

Wire format: a ZMQ multipart message. Frame 0 is one kind byte followed by a msgpack header (a
dataclass below); any further frames are raw pixel buffers (uint8), so pixels are never copied
into a header. Headers are decoded with validation against their dataclass: a malformed message
fails loudly at the boundary (:class:`ProtocolError`), never deep inside the scheduler.

:class:`ImageRequest` declares, per field, how the field takes part in batching (see
:data:`ROLES`). Each batching mode says which roles it can vary per sample
(:data:`VARIES_PER_SAMPLE`); the batch signature is every other field. So the signature follows
the engine, and no list of field names exists anywhere.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Sequence

import msgspec

from diffserve.tasks import GENERATE, Task, task_named

# How a request field takes part in batching:
SHAPE = "shape"              # fixes tensor shapes: equal for every sample of a forward, in any mode
CALL = "call"                # one value per pipeline call; the step engine varies it per sample
SAMPLE = "sample"            # may differ between the samples of one forward, in any mode
BOOKKEEPING = "bookkeeping"  # identifies or tracks the request; never affects what is computed
ROLES = (SHAPE, CALL, SAMPLE, BOOKKEEPING)

REQUEST_MODE = "request"
STEP_MODE = "step"
# Which roles each batching mode can vary inside one batch (request mode) or one running set
# (step mode). The step engine runs every sample on its own noise schedule, so CALL fields
# (steps, guidance, strength, task) may differ there.
VARIES_PER_SAMPLE: dict[str, frozenset[str]] = {
    REQUEST_MODE: frozenset({SAMPLE}),
    STEP_MODE: frozenset({SAMPLE, CALL}),
}

# Seeds are 32-bit, as the API accepts them; image i of a request uses (seed + i) modulo this.
SEED_MODULUS = 2**32

# How a work item ended.
FINISHED, FAILED, CANCELLED = "finished", "failed", "cancelled"
OUTCOMES = (FINISHED, FAILED, CANCELLED)


def _role(role: str, default: Any) -> Any:
    return field(default=default, metadata={"batch": role})


def shape(default: Any = dataclasses.MISSING) -> Any:
    return _role(SHAPE, default)


def call(default: Any = dataclasses.MISSING) -> Any:
    return _role(CALL, default)


def sample(default: Any = dataclasses.MISSING) -> Any:
    return _role(SAMPLE, default)


def bookkeeping(default: Any = dataclasses.MISSING) -> Any:
    return _role(BOOKKEEPING, default)


@cache
def fields_with_role(cls: type, role: str) -> tuple[str, ...]:
    names = []
    for f in dataclasses.fields(cls):
        declared = f.metadata.get("batch")
        if declared not in ROLES:
            raise TypeError(f"{cls.__name__}.{f.name} does not declare its batching role")
        if declared == role:
            names.append(f.name)
    return tuple(names)


@cache
def signature_fields(cls: type, mode: str) -> tuple[str, ...]:
    """The fields two requests must agree on to share a forward in ``mode``."""
    varies = VARIES_PER_SAMPLE[mode] | {BOOKKEEPING}
    return tuple(name for role in ROLES if role not in varies
                 for name in fields_with_role(cls, role))


@dataclass(frozen=True)
class ImageRequest:
    """A validated request (generation or edit) as the engine sees it."""

    request_id: str = bookkeeping()
    model: str = shape()
    width: int = shape()
    height: int = shape()
    task: str = call(GENERATE.name)  # a name in diffserve.tasks.TASKS
    num_inference_steps: int = call(20)
    guidance_scale: float = call(5.0)
    strength: float = call(1.0)  # edits: how far from the input image (1.0: ignore it)
    prompt: str = sample("")
    negative_prompt: str = sample("")
    seed: int = sample(0)
    n: int = sample(1)
    partial_images: int = sample(0)  # streamed previews per image (0-3)

    def signature(self, mode: str) -> tuple:
        return tuple(getattr(self, name) for name in signature_fields(type(self), mode))

    @property
    def task_spec(self) -> Task:
        return task_named(self.task)

    @property
    def input_frames(self) -> int:
        return len(self.task_spec.inputs)

    def seed_of(self, index: int) -> int:
        """The seed of image ``index``: consecutive from the request's seed, wrapping at 2**32."""
        return (self.seed + index) % SEED_MODULUS


@dataclass(frozen=True)
class WorkItem:
    """Images ``start``..``stop-1`` of one request, handed to an executor. Its input frames (if
    the request is an edit) follow the header, item after item."""

    request: ImageRequest
    start: int
    stop: int

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
    status: str  # one of OUTCOMES
    execution_s: float  # pipeline time this item took part in (request mode: the whole call)
    error: str | None = None
    prompt_tokens: int = 0


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
class Cancel:
    """Scheduler to executor: these requests' callers have gone; drop their work."""

    request_ids: list[str]


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
    tasks: list[str]  # names in diffserve.tasks.TASKS
    partial_images: bool  # whether streamed previews are real intermediate decodes
    family: str | None = None  # the step engine's family, where it knows the pipeline


@dataclass(frozen=True)
class ExecutorState:
    index: int
    state: str  # starting | ready | restarting | failed
    device: str
    pid: int | None = None
    restarts: int = 0


@dataclass(frozen=True)
class EngineStatus:
    """Scheduler to frontend: the executors' states (ready while at least one is)."""

    executors: list[ExecutorState]

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


PAYLOADS: dict[Kind, type] = {
    Kind.SUBMIT: ImageRequest, Kind.ABORT: Abort, Kind.READY: ModelInfo,
    Kind.REQUEST_DONE: RequestDone, Kind.REQUEST_FAILED: RequestFailed,
    Kind.ENGINE_STATUS: EngineStatus, Kind.WORK: Work, Kind.ITEMS_DONE: ItemsDone,
    Kind.SHUTDOWN: Empty, Kind.FATAL: Fatal, Kind.CANCEL: Cancel, Kind.PARTIAL: Partial,
    Kind.DRAIN: Empty, Kind.IMAGES: ItemImages,
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
