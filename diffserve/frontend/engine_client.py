"""The frontend's end of the ZMQ link to the engine (the scheduler and its executors).

One long-lived socket per direction (the frontend binds both), one queue per request, and a
single reader task that routes every message to its request: previews as they come, then one
final answer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from diffserve.errors import APIError, engine_error, unavailable
from diffserve.protocol import (
    Abort,
    EngineStatus,
    ImageRequest,
    Kind,
    ModelInfo,
    Partial,
    RequestDone,
    decode,
    encode,
)


class StartupError(RuntimeError):
    pass


@dataclass
class Preview:
    """A partial image of one of the request's images."""

    partial: Partial
    frame: Any


@dataclass
class Done:
    done: RequestDone
    frames: list[Any]


class Submission:
    """One request in flight: its events in order (previews, then one Done), or its error."""

    def __init__(self, client: "EngineClient", request_id: str, queue: asyncio.Queue) -> None:
        self._client, self.request_id, self._queue = client, request_id, queue
        self.answered = False

    async def next(self) -> Preview | Done:
        """The next event; raises the engine's error for the request. Cancelling it is safe."""
        event = await self._queue.get()
        if isinstance(event, Exception):
            self.answered = True
            raise event
        if isinstance(event, Done):
            self.answered = True
        return event

    def close(self) -> None:
        """Done with it: if no answer came (the caller went away), the engine drops the work."""
        if self._client._pending.pop(self.request_id, None) is not None and not self.answered:
            self._client._abort(self.request_id)


class EngineClient:
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
        self.status = EngineStatus([])
        self.draining = False  # stopping: refuse new work, finish what was accepted
        self.stopped_reason: str | None = None
        self._pending: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        """At least one executor serves, and the engine has not stopped."""
        return self.status.ready and not self.stopped_reason

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
                elif kind is Kind.ENGINE_STATUS:
                    self.status = msg
                elif kind is Kind.FATAL:
                    raise StartupError(msg.message)
                if self.model_info is not None and self.status.ready:
                    return self.model_info
            elif scheduler_sentinel in events:
                raise StartupError("the scheduler process exited during start-up")

    async def start(self) -> None:
        self._out = zmq.asyncio.Socket.from_socket(self._out)
        self._in = zmq.asyncio.Socket.from_socket(self._in)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def submit(self, request: ImageRequest, frames: list[Any] = ()) -> "Submission":
        """Send a request; read its previews and answer from the returned submission, and
        close it when done with it (closing early tells the engine to drop the work)."""
        if self.stopped_reason:
            raise unavailable(self.stopped_reason)
        queue: asyncio.Queue = asyncio.Queue()
        self._pending[request.request_id] = queue
        try:
            await self._out.send_multipart(encode(Kind.GENERATE, request, frames), copy=False)
        except BaseException:
            self._pending.pop(request.request_id, None)
            raise
        return Submission(self, request.request_id, queue)

    async def generate(self, request: ImageRequest, frames: list[Any] = ()) -> Done:
        """Send a request and wait for its one final answer (previews are not asked for)."""
        submission = await self.submit(request, frames)
        try:
            while True:
                event = await submission.next()
                if isinstance(event, Done):
                    return event
        finally:
            submission.close()

    def _abort(self, request_id: str) -> None:
        """Tell the scheduler to drop a request, without awaiting: this runs while the caller's
        task is being cancelled, when an await would be cancelled too."""
        frames = encode(Kind.ABORT, Abort(request_id))
        try:
            self._out_sync.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # the queue to the scheduler is full: send it as soon as it drains
            asyncio.get_running_loop().create_task(self._out.send_multipart(frames))

    def fail_all(self, error: APIError) -> None:
        self.stopped_reason = error.message
        for queue in self._pending.values():
            queue.put_nowait(error)
        self._pending.clear()

    async def drain(self) -> None:
        """Stopping: what waits is sent to the executors without waiting for company."""
        self.draining = True
        await self._out.send_multipart(encode(Kind.DRAIN))

    async def _read(self) -> None:
        while True:
            frames = await self._in.recv_multipart(copy=False)
            kind, msg, buffers = decode(frames)
            if kind is Kind.REQUEST_DONE:
                self._route(msg.request_id, Done(msg, buffers))
            elif kind is Kind.PARTIAL:
                self._route(msg.request_id, Preview(msg, buffers[0]))
            elif kind is Kind.REQUEST_FAILED:
                self._route(msg.request_id, engine_error(msg.status, msg.message, msg.type, msg.code))
            elif kind is Kind.ENGINE_STATUS:
                self.status = msg
            elif kind is Kind.FATAL:
                self.fail_all(unavailable(f"the engine stopped: {msg.message}"))

    def _route(self, request_id: str, event: Any) -> None:
        queue = self._pending.get(request_id)
        if queue is not None:
            queue.put_nowait(event)

    def send_shutdown(self) -> None:
        try:
            self._out_sync.send_multipart(encode(Kind.SHUTDOWN), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the scheduler is gone already

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
        self._in.close()
