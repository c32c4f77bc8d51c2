"""Scheduler process: IO around :class:`~diffserve.scheduler.core.SchedulerCore`.

Sockets: PULL from the frontend, PUSH to it, and one ROUTER to every executor. Each executor
connects a DEALER whose identity names its slot and its start (``index:generation``), so every
message to or from an executor is addressed: work, cancels and results always concern a named
executor, and a message from a process that has since been replaced is recognised and dropped.
Executors send pixels straight to the frontend; here only their result headers arrive.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

import zmq

from diffserve import metrics, processes
from diffserve.config.executors import executor_threads
from diffserve.metrics import WEIGHT_OUTCOMES
from diffserve.config.flags import ServerConfig
from diffserve.executor.entry import ExecutorSpec, run_executor
from diffserve.policies import queue_policy_for
from diffserve.wire.protocol import (
    AdapterSync,
    Pause,
    BackendStatus,
    Fatal,
    Kind,
    FramesMismatch,
    ProtocolError,
    decode,
    encode,
)
from diffserve.wire.weight_commands import SHARED
from diffserve.scheduler.adapters import AdapterOutcome, AdapterRegistry
from diffserve.scheduler.weight_updates import Actions, WeightControl
from diffserve.scheduler.core import Finished, SchedulerCore
from diffserve.scheduler.slots import Pricing
from diffserve.scheduler.supervisor import FAILED, ExecutorSupervisor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerSpec:
    config: ServerConfig
    request_addr: str   # frontend -> scheduler (the frontend binds)
    result_addr: str    # scheduler and executors -> frontend (the frontend binds)
    ipc_dir: str
    metrics_dir: str
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
    metrics.record_to(spec.metrics_dir)
    scheduler = SchedulerProc(spec)
    try:
        scheduler.run()
    except BaseException:
        # Say why, and take the executors down first: multiprocessing waits for a process's
        # children before it reports its error, so with them alive this process would linger,
        # and the frontend, which watches it, would never learn that it is gone.
        log.exception("the scheduler failed; stopping its executors")
        scheduler.supervisor.kill_all()
        raise


class SchedulerProc:
    def __init__(self, spec: SchedulerSpec) -> None:
        self.spec = spec
        c = self.config = spec.config
        self.core = SchedulerCore(c.dynamic_batch_max_size, c.dynamic_batch_delay_s,
                                  c.num_executors, c.max_queue_size, c.request_timeout_s,
                                  policy=queue_policy_for(c),
                                  max_loras=c.max_loras if c.serves_adapters else 0)
        self._waits_counted = 0
        self.metrics = metrics.ProcessMetrics()
        self.classes = metrics.BoundedLabels(metrics.PRIORITY_LABELS)
        self.metrics.max_queue_size.set(c.max_queue_size)
        for index in range(c.num_executors):
            self.metrics.declare_executor(index)
            self.metrics.group_ranks.labels(executor=str(index)).set(c.degrees.size)
        self.ctx = zmq.Context()
        self.from_frontend = self._socket(zmq.PULL, spec.request_addr, bind=False)
        self.to_frontend = self._socket(zmq.PUSH, spec.result_addr, bind=False)
        self.executor_addr = f"ipc://{spec.ipc_dir}/executors"
        self.executors = self._socket(zmq.ROUTER, self.executor_addr, bind=True)
        # A send to an executor that is gone raises instead of vanishing silently.
        self.executors.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.supervisor = ExecutorSupervisor(c.executor_devices(), self._start_executor)
        self.adapters = AdapterRegistry(c.lora_adapters)
        self.weights = WeightControl(c.reject_while_sleeping)
        self._weights_began: dict[str, float] = {}  # command id -> when it came
        for outcome in WEIGHT_OUTCOMES:
            self.metrics.weight_updates_total.labels(outcome=outcome)
        self.announced = False  # the frontend has the model info
        self.stopping = False

    def _socket(self, kind: int, addr: str, bind: bool) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(addr) if bind else sock.connect(addr)
        return sock

    def _start_executor(self, index: int, device: str, identity: bytes):
        spec = ExecutorSpec(
            self.config, index, device, executor_threads(self.config, os.cpu_count() or 1),
            self.executor_addr, identity, self.spec.result_addr, self.spec.metrics_dir, os.getpid())
        return processes.start(run_executor, spec, f"diffserve::executor-{index}")

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> None:
        self.supervisor.start_all()
        self._publish_status()
        while not self.stopping:
            poller = zmq.Poller()
            poller.register(self.from_frontend, zmq.POLLIN)
            poller.register(self.executors, zmq.POLLIN)
            sentinels = self.supervisor.sentinels()
            for sentinel in sentinels:
                poller.register(sentinel, zmq.POLLIN)
            events = dict(poller.poll(self._poll_timeout_ms()))
            if self.executors in events:
                self._drain_executors()
            if self.from_frontend in events and not self.stopping:
                self._drain_frontend()
            for sentinel, index in sentinels.items():
                if sentinel in events and not self.stopping:
                    self._executor_died(index)
            if self.stopping:
                break
            now = time.monotonic()
            self._answer(self.core.expire(now))
            self._dispatch(now)
            self.metrics.num_requests_waiting.set(self.core.num_waiting)
            self.metrics.num_requests_running.set(self.core.num_running)
            self.metrics.num_requests_paused.set(self.core.num_paused)

    def _poll_timeout_ms(self) -> int | None:
        sleep_s, timeout_ms = split_wait(self.core.time_until_wakeup(time.monotonic()))
        if sleep_s:
            time.sleep(sleep_s)
        return timeout_ms

    def _drain_frontend(self) -> None:
        now = time.monotonic()
        while not self.stopping:
            try:
                frames = self.from_frontend.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                kind, msg, buffers = decode(frames)
            except FramesMismatch as error:  # a request to answer: it cannot be run
                log.error("refused a request from the frontend: %s", error)
                if error.kind is Kind.SUBMIT and (refused := self.core.refuse_malformed(
                        error.message, str(error))):
                    self._answer([refused])
                continue
            except ProtocolError as error:
                log.error("dropped a malformed message from the frontend: %s", error)
                continue
            if kind is Kind.SUBMIT:
                rejected = self.core.add(msg, buffers, now)
                if rejected:
                    self._answer([rejected])
            elif kind is Kind.ABORT:
                if self.core.abort(msg.request_id):
                    self.metrics.requests_cancelled_total.inc()
                self._send_cancels()
            elif kind is Kind.ADAPTER:
                self._adapter_command(msg)
            elif kind is Kind.WEIGHTS:
                self._weights_began[msg.command_id] = time.monotonic()
                ready = [i for i, slot in enumerate(self.core.slots) if slot.ready]
                self._weights_actions(self.weights.begin(msg, ready, self.core.busy), msg.op)
            elif kind is Kind.DRAIN:
                self.core.start_drain()
            elif kind is Kind.SHUTDOWN:
                self._shutdown()

    def _drain_executors(self) -> None:
        now = time.monotonic()
        while True:
            try:
                identity, *frames = self.executors.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            index = self.supervisor.index_of(identity.bytes)
            if index is None:
                continue  # a replaced process's last words
            try:
                kind, msg, buffers = decode(frames)
            except ProtocolError as error:
                log.error("executor %d sent a malformed message: %s", index, error)
                continue
            if kind is Kind.ITEMS_DONE:
                self._answer(self.core.complete(index, msg, now))
                self._weights_actions(self.weights.tick(self.core.busy))
            elif kind is Kind.WEIGHTS_DONE:
                op = self.weights.running.command.op if self.weights.running else None
                self._weights_actions(self.weights.answered(index, msg, self.core.busy), op)
            elif kind is Kind.ADAPTER_DONE:
                self._adapter_outcome(self.adapters.answered(index, msg))
            elif kind is Kind.READY:
                self._executor_loaded(index, msg, now)
            elif kind is Kind.FATAL:
                self._executor_cannot_load(index, msg)

    def _adapter_command(self, command) -> None:
        ready = [i for i, slot in enumerate(self.core.slots) if slot.ready]
        answer = self.adapters.begin(command, ready)
        if answer is not None:
            self.to_frontend.send_multipart(encode(Kind.ADAPTER_DONE, answer))
            return
        for index in ready:
            self._send_executor(index, encode(Kind.ADAPTER, command))

    def _adapter_outcome(self, outcome: AdapterOutcome) -> None:
        for index in outcome.resync:  # undo a command that failed elsewhere
            self._send_executor(index, encode(Kind.ADAPTER_SYNC, AdapterSync(self.adapters.table())))
        if outcome.answer is not None:
            self.to_frontend.send_multipart(encode(Kind.ADAPTER_DONE, outcome.answer))

    def _weights_actions(self, actions: Actions, op: str | None = None) -> None:
        """Carry out what the weight control decided (:mod:`diffserve.scheduler.weight_updates`)."""
        if actions.fail_started:
            self._answer(self.core.fail_started(503, actions.fail_started, "weights_updated"))
        for index, step in actions.sends:
            self._send_executor(index, encode(Kind.WEIGHT_STEP, step))
        if actions.sync_others is not None:
            for index, slot in enumerate(self.core.slots):
                if slot.ready and index not in actions.sync_others:
                    for step in self.weights.state_steps(f"state-{index}"):
                        self._send_executor(index, encode(Kind.WEIGHT_STEP, step))
        if actions.hold is not None:
            self.core.held = actions.hold
            self.metrics.queue_held.set(int(actions.hold))
        w = self.weights
        self.core.refusing = ("The server is sleeping (POST /v1/sleep) and answers new requests "
                              "only once it wakes (POST /v1/wake_up)."
                              if w.sleeping and w.reject_while_sleeping else None)
        self.core.weight_version = w.version
        for path in actions.delete:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if actions.changed:
            self.metrics.sleeping.set(w.sleeping)
            self._publish_status()
        answer = actions.answer
        if answer is not None:
            began = self._weights_began.pop(answer.command_id, None)
            if op == "update":
                outcome = ("applied" if answer.status == 200 else
                           "failed" if answer.status >= 500 else "refused")
                self.metrics.weight_updates_total.labels(outcome=outcome).inc()
                if answer.status == 200 and began is not None:
                    self.metrics.weight_update_seconds.observe(time.monotonic() - began)
                log.info("weight update %s: %s", answer.version if answer.status == 200 else
                         "refused", answer.error or f"applied in "
                         f"{time.monotonic() - (began or time.monotonic()):.2f} s")
            self.to_frontend.send_multipart(encode(Kind.WEIGHTS_DONE, answer))

    def _executor_loaded(self, index: int, info, now: float) -> None:
        self.supervisor.loaded(index, info.device)
        # Before any work: what changed at run time while it was loading (or away).
        self._send_executor(index, encode(Kind.ADAPTER_SYNC, AdapterSync(self.adapters.table())))
        for step in self.weights.catch_up(f"catch-up-{index}"):
            self._send_executor(index, encode(Kind.WEIGHT_STEP, step))
        if not self.announced:
            self.core.set_mode(info.batching_mode, info.max_batch_cost, info.max_running_cost,
                               info.task_modes, frozenset(
                                   key for key in info.mixed_sizes if info.mixes_sizes(key)),
                               Pricing.of(info))
            self.metrics.batching_mode.labels(mode=info.batching_mode).set(1)
            self.to_frontend.send_multipart(encode(Kind.READY, info))
            self.announced = True
        self.core.executor_ready(index, now)
        self.metrics.executor_ready.labels(executor=str(index)).set(1)
        self._publish_status()
        log.info("executor %d is ready (%s, %s mode)", index, info.device, info.batching_mode)

    def _executor_cannot_load(self, index: int, fatal: Fatal) -> None:
        if not self.announced:  # the model itself cannot load: the server cannot start
            self._stop(fatal)
            return
        log.error("executor %d could not load the model: %s", index, fatal.message)
        self.supervisor.fail(index)
        self._publish_status()
        if self.supervisor.all_failed():
            self._stop(Fatal(f"no executor could load the model: {fatal.message}"))

    def _executor_died(self, index: int) -> None:
        """Answer what the dead executor held; the supervisor starts another unless hopeless."""
        self._drain_executors()  # its last words (a result, or why it could not load)
        if self.stopping or self.supervisor.executors[index].state == FAILED:
            return
        pid = self.supervisor.executors[index].process.pid
        death = self.supervisor.died(index, restart=self.announced)
        metrics.process_died(pid)
        self.metrics.executor_ready.labels(executor=str(index)).set(0)
        # Not-ready first, so that a client told of the failure already finds /health updated.
        self._publish_status()
        reason = (f"executor {index} exited unexpectedly (exit code {death.exit_code}) while "
                  "running this request; it is being restarted")
        self._answer(self.core.executor_lost(index, reason, time.monotonic()))
        for outcome in self.adapters.executor_lost(index):
            self._adapter_outcome(outcome)
        op = self.weights.running.command.op if self.weights.running else None
        self._weights_actions(self.weights.executor_lost(index, self.core.busy), op)
        self._weights_actions(self.weights.tick(self.core.busy))
        if not self.announced:
            self._stop(Fatal(f"the executor died before loading the model (exit code "
                             f"{death.exit_code})"))
        elif death.restarted:
            self.metrics.executor_restarts_total.labels(executor=str(index)).inc()
            if self.config.degrees.size > 1:
                self.metrics.group_restarts_total.labels(executor=str(index)).inc()
        elif self.supervisor.all_failed():
            self._stop(Fatal("every executor died repeatedly before loading the model"))

    def _dispatch(self, now: float) -> None:
        dispatched = self.core.dispatch(now)
        if self.core.waits_for_room > self._waits_counted:
            self.metrics.set_waits_total.inc(self.core.waits_for_room - self._waits_counted)
            self._waits_counted = self.core.waits_for_room
        for index, keys in self.core.take_pauses():  # before the work they make room for
            self._send_executor(index, encode(Kind.PAUSE, Pause(keys)))
            self.metrics.preemptions_total.labels(executor=str(index)).inc(len(keys))
        for d in dispatched:
            label = str(d.executor)
            self._send_executor(d.executor, encode(Kind.WORK, d.work, d.frames))
            self.metrics.batch_size.labels(executor=label).observe(
                sum(item.samples for item in d.work.items))
            self.metrics.dispatches_total.labels(reason=d.reason, executor=label).inc()
            for q, priority in zip(d.queue_times_s, d.priorities):
                self.metrics.queue_time_seconds.observe(q)
                self.metrics.class_queue_time_seconds.labels(
                    priority=self.classes.label(priority)).observe(q)

    def _send_cancels(self) -> None:
        for index, cancel in self.core.take_cancels():
            self._send_executor(index, encode(Kind.CANCEL, cancel))

    def _send_executor(self, index: int, frames: list) -> None:
        try:
            self.executors.send_multipart([self.supervisor.identity(index), *frames], copy=False)
        except zmq.ZMQError as error:  # gone: its sentinel fires next and its work is answered
            log.warning("could not reach executor %d: %s", index, error)

    def _answer(self, finished: list[Finished]) -> None:
        for f in finished:
            if f.done is not None:
                self.to_frontend.send_multipart(encode(Kind.REQUEST_DONE, f.done))
                self.metrics.request_execution_seconds.observe(f.execution_s)
            else:
                self.to_frontend.send_multipart(encode(Kind.REQUEST_FAILED, f.failed))
        self._send_cancels()  # the other parts of a request that failed

    def _publish_status(self) -> None:
        self.to_frontend.send_multipart(encode(Kind.BACKEND_STATUS, BackendStatus(
            self.supervisor.states(), self.weights.version, self.weights.sleeping)))

    def _stop(self, fatal: Fatal) -> None:
        """The engine cannot serve: answer everything, tell the frontend, stop the executors."""
        self._answer(self.core.fail_all(503, fatal.message))
        self.to_frontend.send_multipart(encode(Kind.FATAL, fatal))
        self._stop_executors()
        self.stopping = True

    def _shutdown(self) -> None:
        self._answer(self.core.fail_all(503, "the server is shutting down"))
        for source in self.weights.sources:  # a trainer's tensors the server took over
            if source.kind == SHARED:
                with contextlib.suppress(OSError):
                    os.unlink(source.path)
        self._stop_executors()
        self.stopping = True

    def _stop_executors(self) -> None:
        self.supervisor.stop_all(lambda i: self._send_executor(i, encode(Kind.SHUTDOWN)))
