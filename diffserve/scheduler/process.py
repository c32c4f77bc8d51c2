"""Scheduler process: IO around :class:`~diffserve.scheduler.core.SchedulerCore`.

Owns the executor process too: it starts it, watches it (its exit is an event in the same
poll as the sockets), answers the requests it held when it dies, and starts a new one.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import zmq

from diffserve import processes
from diffserve.config import ServerConfig
from diffserve.executor.process import ExecutorSpec, run_executor
from diffserve.protocol import CancelBatch, EngineStatus, Fatal, Kind, decode, encode
from diffserve.scheduler.core import Finished, SchedulerCore

log = logging.getLogger(__name__)

# An executor that dies this many times in a row before loading its model will not get better.
MAX_FAILED_STARTS = 3


@dataclass(frozen=True)
class SchedulerSpec:
    config: ServerConfig
    request_addr: str   # frontend -> scheduler (the frontend binds)
    result_addr: str    # scheduler -> frontend (the frontend binds)
    ipc_dir: str
    parent_pid: int


def split_wait(wait_s: float | None) -> tuple[float, int | None]:
    """(seconds to sleep now, poll timeout in ms) for a wait until the next deadline.

    ZMQ polls in whole milliseconds. Rounding a batch's deadline up would add half a millisecond
    on average to every delayed batch, so the poll wakes at or before it and the last fraction of
    a millisecond is slept precisely (time.sleep has microsecond resolution)."""
    if wait_s is None:
        return 0.0, None
    if wait_s >= 0.001:
        return 0.0, int(wait_s * 1000)
    return max(0.0, wait_s), 0


def run_scheduler(spec: SchedulerSpec) -> None:
    processes.become("diffserve::scheduler", spec.parent_pid, spec.config.log_level)
    SchedulerProc(spec).run()


class SchedulerProc:
    def __init__(self, spec: SchedulerSpec) -> None:
        from diffserve.metrics import metrics

        self.spec = spec
        self.config = spec.config
        c = self.config
        self.core = SchedulerCore(c.dynamic_batch_max_size, c.dynamic_batch_delay_s,
                                  c.max_queue_size, c.request_timeout_s)
        self.metrics = metrics()
        self.ctx = zmq.Context()
        self.from_frontend = self._socket(zmq.PULL, spec.request_addr, bind=False)
        self.to_frontend = self._socket(zmq.PUSH, spec.result_addr, bind=False)
        self.batch_addr = f"ipc://{spec.ipc_dir}/batches"
        self.to_executor = self._socket(zmq.PUSH, self.batch_addr, bind=True)
        self.executor_result_addr = f"ipc://{spec.ipc_dir}/batch-results"
        self.from_executor = self._socket(zmq.PULL, self.executor_result_addr, bind=True)
        self.executor = None
        self.announced = False  # the frontend has the model info
        self.failed_starts = 0

    def _socket(self, kind: int, addr: str, bind: bool) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(addr) if bind else sock.connect(addr)
        return sock

    def _start_executor(self) -> None:
        c = self.config
        spec = ExecutorSpec(c.model, c.model_name, c.device, c.dtype, c.torch_threads,
                            self.batch_addr, self.executor_result_addr, os.getpid(), c.log_level)
        self.executor = processes.start(run_executor, spec, "diffserve::executor")
        log.info("started executor pid %d", self.executor.pid)

    def run(self) -> None:
        self._start_executor()
        poller = zmq.Poller()
        poller.register(self.from_frontend, zmq.POLLIN)
        poller.register(self.from_executor, zmq.POLLIN)
        sentinel = self.executor.sentinel
        poller.register(sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll(self._poll_timeout_ms()))
            if self.from_executor in events:
                if self._drain_executor() is False:
                    return
            if self.from_frontend in events:
                if self._drain_frontend() is False:
                    return
            if sentinel in events:
                poller.unregister(sentinel)
                if not self._executor_died():
                    return
                sentinel = self.executor.sentinel
                poller.register(sentinel, zmq.POLLIN)
            self._answer(self.core.expire(time.monotonic()))
            self._dispatch()
            self.metrics.num_requests_waiting.set(self.core.num_waiting)
            self.metrics.num_requests_running.set(self.core.num_running)

    def _poll_timeout_ms(self) -> int | None:
        sleep_s, timeout_ms = split_wait(self.core.time_until_wakeup(time.monotonic()))
        if sleep_s:
            time.sleep(sleep_s)
        return timeout_ms

    def _drain_frontend(self) -> bool:
        now = time.monotonic()
        while True:
            try:
                frames = self.from_frontend.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            kind, msg, _ = decode(frames)
            if kind is Kind.GENERATE:
                rejected = self.core.add(msg, now)
                if rejected:
                    self._answer([rejected])
            elif kind is Kind.ABORT:
                if self.core.abort(msg.request_id):
                    self.metrics.requests_cancelled_total.inc()
                if self.core.abort_leaves_batch_unwanted(msg.request_id):
                    self.to_executor.send_multipart(encode(
                        Kind.CANCEL_BATCH, CancelBatch(self.core.running.batch_id)))
            elif kind is Kind.SHUTDOWN:
                self._shutdown()
                return False

    def _drain_executor(self) -> bool:
        while True:
            try:
                frames = self.from_executor.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            kind, msg, buffers = decode(frames)
            if kind is Kind.BATCH_RESULT:
                self._answer(self.core.complete(msg, buffers))
            elif kind is Kind.READY:
                self.core.executor_ready = True
                self.failed_starts = 0
                if not self.announced:
                    self.to_frontend.send_multipart(encode(Kind.READY, msg))
                    self.announced = True
                else:
                    self.to_frontend.send_multipart(encode(Kind.ENGINE_STATUS, EngineStatus(True)))
                log.info("executor pid %d is ready", self.executor.pid)
            elif kind is Kind.FATAL and not self.announced:
                self.to_frontend.send_multipart(encode(Kind.FATAL, msg))
                self._stop_executor()
                return False
            elif kind is Kind.FATAL:
                log.error("executor could not restart: %s", msg.message)

    def _executor_died(self) -> bool:
        """Answer what the dead executor held and start another. False if hopeless."""
        if not self._drain_executor():  # its last words (a result, or why it could not load)
            return False
        self.executor.join()
        code = self.executor.exitcode
        from diffserve.metrics import process_died

        process_died(self.executor.pid)
        was_ready = self.core.executor_ready
        reason = (f"the executor process exited unexpectedly (exit code {code}) while running "
                  "this request; it is being restarted")
        log.error("executor pid %d died with exit code %s", self.executor.pid, code)
        # Not-ready first, so that a client told of the failure finds /health already 503.
        self.to_frontend.send_multipart(encode(Kind.ENGINE_STATUS, EngineStatus(False)))
        self._answer(self.core.executor_lost(reason))
        self.failed_starts = 0 if was_ready else self.failed_starts + 1
        if not self.announced or self.failed_starts >= MAX_FAILED_STARTS:
            message = f"the executor died before loading the model (exit code {code})"
            self._answer(self.core.fail_all(503, message))
            self.to_frontend.send_multipart(encode(Kind.FATAL, Fatal(message)))
            return False
        self.metrics.executor_restarts_total.inc()
        self._start_executor()
        return True

    def _dispatch(self) -> None:
        d = self.core.dispatch(time.monotonic())
        if d is None:
            return
        self.to_executor.send_multipart(encode(Kind.BATCH, d.batch))
        self.metrics.batch_size.observe(len(d.batch.samples))
        for q in d.queue_times_s:
            self.metrics.queue_time_seconds.observe(q)

    def _answer(self, finished: list[Finished]) -> None:
        for f in finished:
            if f.done is not None:
                self.to_frontend.send_multipart(encode(Kind.REQUEST_DONE, f.done, f.frames),
                                                copy=False)
                self.metrics.request_execution_seconds.observe(f.execution_s)
            else:
                self.to_frontend.send_multipart(encode(Kind.REQUEST_FAILED, f.failed))

    def _stop_executor(self) -> None:
        if self.executor is not None and self.executor.is_alive():
            self.to_executor.send_multipart(encode(Kind.SHUTDOWN))
            self.executor.join(5)
            processes.stop(self.executor)

    def _shutdown(self) -> None:
        self._answer(self.core.fail_all(503, "the server is shutting down"))
        self._stop_executor()
