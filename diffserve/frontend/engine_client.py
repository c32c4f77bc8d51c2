"""The frontend's end of the ZMQ link to the scheduler.

One long-lived socket per direction (the frontend binds both), one future per request, and a
single reader task that routes every answer to its future.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import zmq
import zmq.asyncio

from diffserve.errors import APIError, engine_error, unavailable
from diffserve.protocol import Abort, GenerationRequest, Kind, ModelInfo, RequestDone, decode, encode


class StartupError(RuntimeError):
    pass


class EngineClient:
    def __init__(self, ctx: zmq.Context, ipc_dir: str) -> None:
        self.request_addr = f"ipc://{ipc_dir}/requests"
        self.result_addr = f"ipc://{ipc_dir}/results"
        self._ctx = ctx
        self._out = ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(self.request_addr)
        self._out_sync = self._out  # usable after the event loop has gone
        self._in = ctx.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(self.result_addr)
        self.model_info: ModelInfo | None = None
        self.engine_ready = False
        self.draining = False  # stopping: refuse new work, finish what was accepted
        self.stopped_reason: str | None = None
        self._pending: dict[str, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

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
                    self.model_info, self.engine_ready = msg, True
                    return msg
                if kind is Kind.FATAL:
                    raise StartupError(msg.message)
            elif scheduler_sentinel in events:
                raise StartupError("the scheduler process exited during start-up")

    async def start(self) -> None:
        self._out = zmq.asyncio.Socket.from_socket(self._out)
        self._in = zmq.asyncio.Socket.from_socket(self._in)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def generate(self, request: GenerationRequest) -> tuple[RequestDone, list[Any]]:
        """Send a request and wait for its one final answer."""
        if self.stopped_reason:
            raise unavailable(self.stopped_reason)
        future = asyncio.get_running_loop().create_future()
        self._pending[request.request_id] = future
        try:
            await self._out.send_multipart(encode(Kind.GENERATE, request))
            return await future
        finally:
            if self._pending.pop(request.request_id, None) is not None:
                # No answer came (our caller went away, so awaiting it was cancelled): the
                # scheduler can drop the work.
                await self._out.send_multipart(encode(Kind.ABORT, Abort(request.request_id)))

    def fail_all(self, error: APIError) -> None:
        self.stopped_reason = error.message
        self.engine_ready = False
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    async def _read(self) -> None:
        while True:
            frames = await self._in.recv_multipart(copy=False)
            kind, msg, buffers = decode(frames)
            if kind is Kind.REQUEST_DONE:
                self._resolve(msg.request_id, (msg, buffers))
            elif kind is Kind.REQUEST_FAILED:
                self._resolve(msg.request_id, engine_error(msg.status, msg.message, msg.type, msg.code))
            elif kind is Kind.ENGINE_STATUS:
                self.engine_ready = msg.executor_ready
            elif kind is Kind.FATAL:
                self.fail_all(unavailable(f"the engine stopped: {msg.message}"))

    def _resolve(self, request_id: str, outcome: Any) -> None:
        future = self._pending.pop(request_id, None)
        if future is None or future.done():
            return
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def send_shutdown(self) -> None:
        try:
            self._out_sync.send_multipart(encode(Kind.SHUTDOWN), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the scheduler is gone already

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
        self._in.close()
