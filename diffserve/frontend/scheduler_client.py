"""The frontend's end of the ZMQ link to the engine (the scheduler and its executors).

One long-lived socket per direction (the frontend binds both), one queue per request, and a
single reader task that routes every message to its request. Two kinds of sender share the
incoming socket: the executors send pixels (each request's images and previews) straight here,
and the scheduler sends each request's final header (done, or failed). The two are not ordered
with respect to each other, so a request is answered once both its header and all of its images
have come; images that do not follow their header within :data:`IMAGES_GRACE_S` were lost with
their executor and the request is answered 500.

If the reader itself fails, every waiting request is answered 503, the client stops accepting
work, and the host is told (``diffserve serve`` then exits non-zero for its supervisor).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from typing import Any, Callable

import zmq
import zmq.asyncio

from diffserve.errors import APIError, engine_error, internal_error, unavailable
from diffserve.wire.protocol import (
    LOAD,
    Abort,
    AdapterCommand,
    AdapterResult,
    BackendStatus,
    ItemImages,
    ItemTensors,
    Kind,
    ProtocolError,
    decode,
    encode,
)
from diffserve.frontend.client_events import (  # noqa: F401 - the events' home for callers
    DoneEvent,
    PartialEvent,
    ProgressEvent,
    StartupError,
    _Pending,
    final_event,
)
from diffserve.wire.rollouts import join_parts
from diffserve.wire.weight_commands import WeightCommand, WeightResult
from diffserve.wire.model_info import ModelInfo
from diffserve.wire.request import ImageRequest

log = logging.getLogger(__name__)

# An executor sends a request's images before it tells the scheduler they are made, but the two
# travel on different sockets. Only a process killed between the two sends loses images whose
# header still arrives; this bounds the wait for them.
IMAGES_GRACE_S = 10.0


class Submission:
    """One request in flight: its events in order (partial images, then one DoneEvent), or its
    error."""

    def __init__(self, client: "SchedulerClient", request_id: str, queue: asyncio.Queue) -> None:
        self._client, self.request_id, self._queue = client, request_id, queue
        self.answered = False

    async def next(self) -> PartialEvent | ProgressEvent | DoneEvent:
        """The next event; raises the engine's error for the request. Cancelling it is safe."""
        event = await self._queue.get()
        if isinstance(event, Exception):
            self.answered = True
            raise event
        if isinstance(event, DoneEvent):
            self.answered = True
        return event

    def close(self) -> None:
        """Done with it: if no answer came (the caller went away), the engine drops the work."""
        if self._client._forget(self.request_id) and not self.answered:
            self._client._abort(self.request_id)


class SchedulerClient:
    def __init__(self, ctx: zmq.Context, ipc_dir: str) -> None:
        self.request_addr = f"ipc://{ipc_dir}/requests"
        self.result_addr = f"ipc://{ipc_dir}/results"
        self._out = ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(self.request_addr)
        self._out_sync = self._out  # usable after the event loop has gone
        self._in = ctx.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(self.result_addr)
        self.model_info: ModelInfo | None = None
        self.status = BackendStatus([])
        self.draining = False  # stopping: refuse new work, finish what was accepted
        self.stopped_reason: str | None = None
        self._pending: dict[str, _Pending] = {}
        self._commands: dict[str, asyncio.Future] = {}  # adapter and weight commands, by id
        self.shared_dir: str | None = None  # where weight updates from shared memory are kept
        self._command_ids = itertools.count(1)
        self.adapters: dict[str, None] = {}  # LoRA adapters served now, in the order they came
        self._reader: asyncio.Task | None = None
        self._on_failure: Callable[[str], None] = lambda reason: None
        self.on_answered: Callable[[], None] = lambda: None  # a request left (several models)

    @property
    def ready(self) -> bool:
        """At least one executor serves, and the engine has not stopped."""
        return self.status.ready and not self.stopped_reason

    in_flight = property(lambda self: len(self._pending))  # sent, not answered: queued or running

    def route(self, name: str | None) -> tuple[ModelInfo, dict[str, None]]:
        """What a request naming ``name`` is checked against (several models: ModelSet's)."""
        return self.model_info, self.adapters

    def model_states(self) -> list[tuple[str, ModelInfo | None, dict]]:
        return [(self.model_info.name, self.model_info, {})]  # name, info, more for /v1/models

    def wait_ready(self, scheduler_sentinel: int, timeout_s: float) -> ModelInfo:
        """Block until the scheduler reports a loaded model (before the event loop starts)."""
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        poller.register(scheduler_sentinel, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StartupError(f"the model did not load within {timeout_s:g} s "
                                   "(--startup-timeout-s)")
            events = dict(poller.poll(int(left * 1000) + 1))
            if self._in in events:
                kind, msg, _ = decode(self._in.recv_multipart())
                if kind is Kind.READY:
                    self.model_info = msg
                    self.adapters = dict.fromkeys(msg.adapters)
                elif kind is Kind.BACKEND_STATUS:
                    self.status = msg
                elif kind is Kind.FATAL:
                    raise StartupError(msg.message)
                if self.model_info is not None and self.status.ready:
                    return self.model_info
            elif scheduler_sentinel in events:
                raise StartupError("the scheduler process exited during start-up")

    async def start(self, on_failure: Callable[[str], None] = lambda reason: None) -> None:
        """Start reading the engine's messages; ``on_failure(reason)`` is called if reading fails."""
        self._on_failure = on_failure
        self._out = zmq.asyncio.Socket.from_socket(self._out)
        self._in = zmq.asyncio.Socket.from_socket(self._in)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def submit(self, request: ImageRequest, frames: list[Any] = ()) -> Submission:
        """Send a request; read its partial images and answer from the returned submission, and
        close it when done with it (closing early tells the engine to drop the work)."""
        if self.stopped_reason:
            raise unavailable(self.stopped_reason)
        pending = _Pending(request.n, request.task_spec.trajectory)
        self._pending[request.request_id] = pending
        try:
            await self._out.send_multipart(encode(Kind.SUBMIT, request, frames), copy=False)
        except BaseException:
            self._forget(request.request_id)
            raise
        return Submission(self, request.request_id, pending.queue)

    async def generate(self, request: ImageRequest, frames: list[Any] = ()) -> DoneEvent:
        """Send a request and wait for its one final answer (partial images are not asked for)."""
        return await final_event(await self.submit(request, frames))

    async def adapter_command(self, op: str, name: str, path: str = "") -> AdapterResult:
        """Load (or replace) or unload a LoRA adapter in every executor; the engine's answer."""
        if self.stopped_reason:
            raise unavailable(self.stopped_reason)
        command_id = f"cmd-{next(self._command_ids)}"
        future = asyncio.get_running_loop().create_future()
        self._commands[command_id] = future
        try:
            await self._out.send_multipart(encode(Kind.ADAPTER, AdapterCommand(command_id, op, name, path)))
            result = await future
        finally:
            self._commands.pop(command_id, None)
        if result.status == 200:
            if op == LOAD:
                self.adapters[name] = None
            else:
                self.adapters.pop(name, None)
        return result

    async def weights_command(self, command: WeightCommand) -> WeightResult:
        """A weight update, sleep or wake over every executor (its ``command_id`` is set
        here); the engine's answer, once the command is over."""
        if self.stopped_reason:
            raise unavailable(self.stopped_reason)
        command = dataclasses.replace(command, command_id=f"cmd-{next(self._command_ids)}")
        future = asyncio.get_running_loop().create_future()
        self._commands[command.command_id] = future
        try:
            await self._out.send_multipart(encode(Kind.WEIGHTS, command))
            return await future
        finally:
            self._commands.pop(command.command_id, None)

    def _forget(self, request_id: str) -> bool:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self.on_answered()
            if pending.grace is not None:
                pending.grace.cancel()
        return pending is not None

    def _abort(self, request_id: str) -> None:
        """Tell the scheduler to drop a request, without awaiting: this runs while the caller's
        task is being cancelled, when an await would be cancelled too."""
        frames = encode(Kind.ABORT, Abort(request_id))
        try:
            self._out_sync.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # the queue to the scheduler is full: send it as soon as it drains
            asyncio.get_running_loop().create_task(self._out.send_multipart(frames))

    def fail_all(self, error: APIError) -> None:
        """Answer every waiting request with ``error`` and accept no more work."""
        self.stopped_reason = error.message
        for request_id in list(self._pending):
            self._finish(request_id, error)
        for future in self._commands.values():
            if not future.done():
                future.set_exception(error)

    async def drain(self) -> None:
        """Stopping: what waits is sent to the executors without waiting for company."""
        self.draining = True
        await self._out.send_multipart(encode(Kind.DRAIN))

    async def _read(self) -> None:
        try:
            while True:
                frames = await self._in.recv_multipart(copy=False)
                try:
                    kind, msg, buffers = decode(frames)
                except ProtocolError as error:
                    log.error("dropped a malformed message from the engine: %s", error)
                    continue
                self._dispatch(kind, msg, buffers)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - nothing could be answered any more
            log.exception("the engine client's reader failed")
            reason = f"the frontend stopped reading the engine's answers ({type(error).__name__}: {error})"
            self.fail_all(unavailable(f"The server failed: {reason}; it is stopping.",
                                      "engine_failed"))
            self._on_failure(reason)

    def _dispatch(self, kind: Kind, msg: Any, buffers: list[Any]) -> None:
        if kind is Kind.IMAGES:
            self._images(msg, buffers)
        elif kind is Kind.TENSORS:
            self._tensors(msg, buffers)
        elif kind is Kind.PROGRESS:
            pending = self._pending.get(msg.request_id)
            if pending is not None:
                pending.queue.put_nowait(ProgressEvent(msg.done, msg.total))
        elif kind is Kind.PARTIAL:
            pending = self._pending.get(msg.request_id)
            if pending is not None and len(buffers) == 1:
                pending.queue.put_nowait(PartialEvent(msg, buffers[0]))
        elif kind is Kind.REQUEST_DONE:
            pending = self._pending.get(msg.request_id)
            if pending is not None:
                pending.done = msg
                if not self._complete(msg.request_id, pending):
                    pending.grace = asyncio.get_running_loop().call_later(
                        IMAGES_GRACE_S, self._images_lost, msg.request_id)
        elif kind is Kind.REQUEST_FAILED:
            self._finish(msg.request_id, engine_error(msg.status, msg.message, msg.type, msg.code))
        elif kind in (Kind.ADAPTER_DONE, Kind.WEIGHTS_DONE):
            future = self._commands.get(msg.command_id)
            if future is not None and not future.done():
                future.set_result(msg)
        elif kind is Kind.BACKEND_STATUS:
            self.status = msg
        elif kind is Kind.FATAL:
            self.fail_all(unavailable(f"the engine stopped: {msg.message}"))

    def _images(self, msg: ItemImages, buffers: list[Any]) -> None:
        pending = self._pending.get(msg.request_id)
        if pending is None:
            return  # answered or abandoned meanwhile
        per_image = 2 if msg.audio_channels else 1  # a video's frames, then its sound track
        if (len(buffers) != (msg.stop - msg.start) * per_image
                or not 0 <= msg.start < msg.stop <= pending.n):
            log.error("dropped malformed images %d..%d (%d frames) of %s", msg.start, msg.stop,
                      len(buffers), msg.request_id)
            return
        indices = range(msg.start, msg.stop)
        pending.images.update(zip(indices, buffers[::per_image]))
        if msg.audio_channels:
            pending.sounds.update((i, (b, msg.audio_channels, msg.sample_rate))
                                  for i, b in zip(indices, buffers[1::2]))
        self._complete(msg.request_id, pending)

    def _tensors(self, msg: ItemTensors, buffers: list[Any]) -> None:
        import numpy as np

        pending = self._pending.get(msg.request_id)
        if pending is None:
            return
        try:
            if len(buffers) != len(msg.tensors) or not 0 <= msg.start < msg.stop <= pending.n:
                raise ValueError(f"{len(buffers)} frames for {len(msg.tensors)} tensors")
            tensors = {spec.name: np.frombuffer(buf, dtype=spec.dtype).reshape(spec.shape)
                       for spec, buf in zip(msg.tensors, buffers)}
        except (ValueError, TypeError) as error:
            log.error("dropped malformed tensors %d..%d of %s: %s", msg.start, msg.stop,
                      msg.request_id, error)
            return
        pending.tensors[msg.start] = (msg.stop, tensors)
        self._complete(msg.request_id, pending)

    def _complete(self, request_id: str, pending: _Pending) -> bool:
        """Answer the request if its header and all of its images (or tensors) are here."""
        if not pending.complete():
            return False
        tensors = (join_parts([(start, part) for start, (_, part) in pending.tensors.items()])
                   if pending.wants_tensors else None)
        self._finish(request_id, DoneEvent(
            pending.done, [] if pending.wants_tensors else [pending.images[i] for i in range(pending.n)],
            tensors, [pending.sounds.get(i) for i in range(pending.n)] if pending.sounds else []))
        return True

    def _images_lost(self, request_id: str) -> None:
        log.error("the images of %s did not arrive within %g s of its answer", request_id,
                  IMAGES_GRACE_S)
        self._finish(request_id, internal_error("The images of this request were lost between "
                                                "the executor and the frontend."))

    def _finish(self, request_id: str, event: Any) -> None:
        """The request's one final event; a late message for it finds nothing and is dropped."""
        pending = self._pending.get(request_id)
        if pending is not None:
            self._forget(request_id)
            pending.queue.put_nowait(event)

    def send_shutdown(self) -> None:
        try:
            self._out_sync.send_multipart(encode(Kind.SHUTDOWN), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the scheduler is gone already

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
        self._in.close()
