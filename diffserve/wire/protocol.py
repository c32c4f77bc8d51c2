"""Every message that crosses a process boundary, in one place.

Wire format: a ZMQ multipart message. Frame 0 is one kind byte followed by a msgpack header (a
dataclass below); any further frames are raw pixel buffers (uint8), so pixels are never copied
into a header. Headers are decoded with validation against their dataclass: a malformed message
fails loudly at the boundary (:class:`ProtocolError`), never deep inside the scheduler.

A request's input frames are declared in its header (``ImageRequest.manifest``: each frame's
role, owner and shape), and :func:`decode` checks the frames that came against it, once
(:class:`FramesMismatch`, which carries the header so that its requests can be answered);
everything downstream trusts them.

The request and the work it becomes are :mod:`diffserve.wire.request`; the model's description,
:mod:`diffserve.wire.model_info`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence

import msgspec

from diffserve.wire.roles import (  # noqa: F401  (the roles are part of the protocol's vocabulary)
    BOOKKEEPING,
    CALL,
    MIXED_STEP_MODE,
    REQUEST_MODE,
    ROLES,
    SAMPLE,
    SHAPE,
    SIZE,
    STEP_MODE,
    VARIES_PER_SAMPLE,
    bookkeeping,
    call,
    fields_with_role,
    key_mode,
    sample,
    shape,
    size,
    batch_key_fields,
)
from diffserve.wire.weight_commands import BASE_VERSION, WeightCommand, WeightResult, WeightStep
from diffserve.wire.model_info import ModelInfo
from diffserve.wire.request import ImageRequest, Work

# How a work item ended.
FINISHED, FAILED, CANCELLED = "finished", "failed", "cancelled"
ITEM_OUTCOMES = (FINISHED, FAILED, CANCELLED)

# Why a batch (request mode) or an admission (step mode) left the scheduler's queue: the scheduler
# decides it, the metrics label dispatches with it.
FULL, DELAY, EXECUTOR_FREE, DRAIN, JOIN, NEW_SET = (
    "full", "delay", "executor_free", "drain", "join", "new_set")
DISPATCH_REASONS = (FULL, DELAY, EXECUTOR_FREE, DRAIN, JOIN, NEW_SET)


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
    # Videos with sound: each image's frame is followed by its sound track's, float32 samples
    # of this many channels, channel after channel, at ``sample_rate`` (0: no sound).
    audio_channels: int = 0
    sample_rate: int = 0


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
class BackendStatus:
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

    SUBMIT = 1          # frontend -> scheduler: ImageRequest + the frames its manifest lists
    ABORT = 2           # frontend -> scheduler: Abort
    READY = 3           # executor -> scheduler -> frontend: ModelInfo
    REQUEST_DONE = 4    # scheduler -> frontend: RequestDone
    REQUEST_FAILED = 5  # scheduler -> frontend: RequestFailed
    BACKEND_STATUS = 6   # scheduler -> frontend: BackendStatus
    WORK = 7            # scheduler -> executor: Work + its items' manifests' frames
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
    Kind.BACKEND_STATUS: BackendStatus, Kind.WORK: Work, Kind.ITEMS_DONE: ItemsDone,
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


class FramesMismatch(ProtocolError):
    """A request or work message whose frames are not those its header declares. It carries
    the decoded header (``message``), whose requests are to be answered with the error."""

    def __init__(self, kind: Kind, message: Any, reason: str) -> None:
        super().__init__(reason)
        self.kind, self.message = kind, message


def declared_frames(kind: Kind, message: Any) -> list | None:
    """The input frames a message's header declares (their specs, in order), or None where its
    kind carries no input frames."""
    if kind is Kind.SUBMIT:
        return list(message.manifest)
    if kind is Kind.WORK:
        return [spec for item in message.items for spec in item.manifest]
    return None


def _nbytes(frame: Any) -> int:
    buffer = frame.buffer if hasattr(frame, "buffer") else frame  # a zmq.Frame's, or itself
    return memoryview(buffer).nbytes


def check_frames(kind: Kind, message: Any, frames: Sequence[Any]) -> None:
    """Raise :class:`FramesMismatch` unless ``frames`` are the input frames the header
    declares: as many, each of its declared size."""
    specs = declared_frames(kind, message)
    if specs is None:
        return
    what = (f"request {message.request_id!r} ({message.task})" if kind is Kind.SUBMIT
            else f"work {message.work_id}")
    if len(frames) != len(specs):
        raise FramesMismatch(kind, message, f"{what} declares {len(specs)} input frames "
                             f"({', '.join(f'{s.role}[{s.owner}]' for s in specs) or 'none'}) "
                             f"but carries {len(frames)}")
    for i, (spec, frame) in enumerate(zip(specs, frames)):
        if _nbytes(frame) != spec.nbytes:
            raise FramesMismatch(kind, message, f"{what}: input frame {i} ({spec.role}"
                                 f"[{spec.owner}], {'x'.join(map(str, spec.shape))} uint8) "
                                 f"holds {_nbytes(frame)} bytes, not {spec.nbytes}")


def encode(kind: Kind, message: Any = None, buffers: Sequence[Any] = ()) -> list[Any]:
    """Frames for ``socket.send_multipart``; ``buffers`` go as-is (bytes, memoryview, zmq.Frame)."""
    payload = Empty() if message is None else message
    if type(payload) is not PAYLOADS[kind]:
        raise ProtocolError(f"a {kind.name} message carries {PAYLOADS[kind].__name__}, "
                            f"not {type(payload).__name__}")
    return [bytes((kind,)) + _ENCODER.encode(payload), *buffers]


def decode(frames: Sequence[Any]) -> tuple[Kind, Any, list[Any]]:
    """Inverse of :func:`encode`: (kind, message, raw buffer frames), the input frames checked
    against the header's manifest."""
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
    buffers = list(frames[1:])
    check_frames(kind, message, buffers)
    return kind, message, buffers
