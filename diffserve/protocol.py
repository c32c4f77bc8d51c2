"""Every message that crosses a process boundary, in one place.

Wire format: a ZMQ multipart message. Frame 0 is one kind byte followed by an orjson header
(a dataclass below); any further frames are raw image buffers (uint8, height x width x 3), so
pixel data is never pickled or copied into JSON.

:class:`GenerationRequest` declares, per field, how the field takes part in batching: ``shared``
fields must be equal for two requests to share a pipeline call, ``per_sample`` fields may differ
inside one call, ``routing`` fields are bookkeeping. The batch signature is derived from that
metadata alone.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Sequence

import orjson

SHARED = "shared"
PER_SAMPLE = "per_sample"
ROUTING = "routing"
_ROLES = (SHARED, PER_SAMPLE, ROUTING)


def shared(default: Any = dataclasses.MISSING) -> Any:
    """Field that must be equal for requests to share one pipeline call."""
    return field(default=default, metadata={"batch": SHARED})


def per_sample(default: Any = dataclasses.MISSING) -> Any:
    """Field that may differ between the samples of one pipeline call."""
    return field(default=default, metadata={"batch": PER_SAMPLE})


def routing(default: Any = dataclasses.MISSING) -> Any:
    """Bookkeeping field that never affects what is computed."""
    return field(default=default, metadata={"batch": ROUTING})


@cache
def fields_with_role(cls: type, role: str) -> tuple[str, ...]:
    names = []
    for f in dataclasses.fields(cls):
        declared = f.metadata.get("batch")
        if declared not in _ROLES:
            raise TypeError(f"{cls.__name__}.{f.name} does not declare its batching role")
        if declared == role:
            names.append(f.name)
    return tuple(names)


@dataclass(frozen=True)
class GenerationRequest:
    """A validated text-to-image request as the engine sees it."""

    request_id: str = routing()
    model: str = shared()
    width: int = shared()
    height: int = shared()
    num_inference_steps: int = shared()
    guidance_scale: float = shared()
    prompt: str = per_sample()
    negative_prompt: str = per_sample("")
    seed: int = per_sample(0)
    n: int = per_sample(1)
    # Seconds since the epoch when the frontend accepted it; used for end-to-end latency only.
    arrival_time: float = routing(0.0)

    def batch_signature(self) -> tuple:
        return tuple(getattr(self, name) for name in fields_with_role(type(self), SHARED))

    def shared_params(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in fields_with_role(type(self), SHARED)}


@dataclass(frozen=True)
class Sample:
    """One image to generate inside a batch: image ``index`` of request ``request_id``."""

    request_id: str
    index: int
    prompt: str
    negative_prompt: str
    seed: int


@dataclass(frozen=True)
class Batch:
    """One pipeline call: the shared parameters and the samples."""

    batch_id: int
    params: dict[str, Any]
    samples: list[Sample]

    @classmethod
    def from_dict(cls, d: dict) -> "Batch":
        return cls(d["batch_id"], d["params"], [Sample(**s) for s in d["samples"]])


@dataclass(frozen=True)
class ImageMeta:
    request_id: str
    index: int
    seed: int


@dataclass(frozen=True)
class BatchResult:
    """Outcome of one batch. ``images`` is aligned with the raw frames that follow the header;
    ``errors`` maps a request id to the message of the error that request alone caused."""

    batch_id: int
    width: int
    height: int
    execution_time_s: float
    images: list[ImageMeta]
    errors: dict[str, str]

    @classmethod
    def from_dict(cls, d: dict) -> "BatchResult":
        return cls(d["batch_id"], d["width"], d["height"], d["execution_time_s"],
                   [ImageMeta(**m) for m in d["images"]], d["errors"])


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


@dataclass(frozen=True)
class RequestDone:
    """All images of one request; followed by ``len(seeds)`` raw frames in index order."""

    request_id: str
    width: int
    height: int
    seeds: list[int]


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
class CancelBatch:
    """Scheduler to executor: every caller of this batch has gone; stop it early."""

    batch_id: int


@dataclass(frozen=True)
class EngineStatus:
    """Scheduler to frontend: whether an executor with a loaded model is serving."""

    executor_ready: bool


@dataclass(frozen=True)
class Fatal:
    """A process could not start (e.g. the model failed to load); the server cannot serve."""

    message: str


class Kind(enum.IntEnum):
    """The one-byte message kind, and what each kind carries."""

    GENERATE = 1        # frontend -> scheduler: GenerationRequest
    ABORT = 2           # frontend -> scheduler: Abort
    READY = 3           # executor -> scheduler -> frontend: ModelInfo
    REQUEST_DONE = 4    # scheduler -> frontend: RequestDone + image frames
    REQUEST_FAILED = 5  # scheduler -> frontend: RequestFailed
    ENGINE_STATUS = 6   # scheduler -> frontend: EngineStatus
    BATCH = 7           # scheduler -> executor: Batch
    BATCH_RESULT = 8    # executor -> scheduler: BatchResult + image frames
    SHUTDOWN = 9        # parent -> child: no payload
    FATAL = 10          # child -> parent: Fatal
    CANCEL_BATCH = 11   # scheduler -> executor: CancelBatch


_PAYLOADS: dict[Kind, type | None] = {
    Kind.GENERATE: GenerationRequest, Kind.ABORT: Abort, Kind.READY: ModelInfo,
    Kind.REQUEST_DONE: RequestDone, Kind.REQUEST_FAILED: RequestFailed,
    Kind.ENGINE_STATUS: EngineStatus, Kind.BATCH: Batch, Kind.BATCH_RESULT: BatchResult,
    Kind.SHUTDOWN: None, Kind.FATAL: Fatal, Kind.CANCEL_BATCH: CancelBatch,
}


def encode(kind: Kind, message: Any = None, buffers: Sequence[Any] = ()) -> list[Any]:
    """Frames for ``socket.send_multipart``; ``buffers`` go as-is (bytes, memoryview, zmq.Frame)."""
    header = bytes((kind,)) + orjson.dumps(message, option=orjson.OPT_SERIALIZE_NUMPY)
    return [header, *buffers]


def decode(frames: Sequence[Any]) -> tuple[Kind, Any, list[Any]]:
    """Inverse of :func:`encode`: (kind, message, raw buffer frames)."""
    head = frames[0]
    head = head.bytes if hasattr(head, "bytes") else bytes(head)
    kind = Kind(head[0])
    payload, cls = orjson.loads(head[1:]), _PAYLOADS[kind]
    if cls is None:
        message = None
    elif hasattr(cls, "from_dict"):
        message = cls.from_dict(payload)
    else:
        message = cls(**payload)
    return kind, message, list(frames[1:])
