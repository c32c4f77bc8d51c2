"""Executor process: IO around one of the two engines.

It connects a DEALER socket to the scheduler's ROUTER under its identity (``index:generation``),
loads the model, says READY (with the batching mode it will run), and then:

- **request mode** (:class:`RequestLoop`): one work message is one pipeline call. While it runs,
  the pipeline's step callback peeks at the socket, so a call whose callers have all gone stops
  at the next denoising step.
- **step mode** (:class:`StepLoop`): between two steps it takes every waiting message, admits
  the new work into the running set, drops cancelled requests, then runs one step. Every
  per-step decision is made here; nothing crosses a process boundary per step.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from diffserve import processes
from diffserve.executor.results import CANCELLED_OUTCOME
from diffserve.protocol import (
    Fatal,
    ItemResult,
    ItemsDone,
    Kind,
    Partial,
    ProtocolError,
    Work,
    decode,
    encode,
)

log = logging.getLogger(__name__)

# How long torch's idle OpenMP workers spin before they sleep, in spin iterations: about 0.2 ms
# of CPU after each pipeline call on the 2-core test machine, against about 5 ms for libgomp's
# default (300,000). That spin holds a core just when the scheduler, the frontend and the client
# need it to answer the batch. Pipeline speed is unchanged (measured, docs/benchmarks.md): the
# gaps between parallel regions inside a call are much shorter.
OPENMP_SPIN_COUNT = 10_000


def bound_openmp_spin() -> None:
    """Set the OpenMP spin before torch loads libgomp, unless the operator chose a policy."""
    if "torch" in sys.modules:
        log.warning("torch was imported before the executor set GOMP_SPINCOUNT; not set")
        return
    if not ({"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys()):
        os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)


@dataclass(frozen=True)
class ExecutorSpec:
    model: str
    served_name: str
    index: int
    device: str
    dtype: str
    torch_threads: int
    batching_mode: str
    address: str      # the scheduler's ROUTER
    identity: bytes   # this process's address there
    parent_pid: int
    log_level: str = "info"


def run_executor(spec: ExecutorSpec) -> None:
    processes.become(f"diffserve::executor-{spec.index}", spec.parent_pid, spec.log_level)
    bound_openmp_spin()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, spec.identity)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(spec.address)
    try:
        loop = build_loop(spec, sock)
    except Exception as error:  # noqa: BLE001 - reported to the operator, then exit
        log.error("could not load model %r:\n%s", spec.model, traceback.format_exc())
        sock.send_multipart(encode(Kind.FATAL, Fatal(f"could not load model {spec.model!r}: "
                                                     f"{type(error).__name__}: {error}")))
        sock.close()
        ctx.term()
        raise SystemExit(1)
    loop.run()
    sock.close()
    ctx.term()


def build_loop(spec: ExecutorSpec, sock: zmq.Socket):
    """Load the model, pick the engine, say READY; the loop that serves it."""
    from diffserve.executor.families import family_for
    from diffserve.executor.loading import (
        edit_pipelines,
        load_model,
        model_info,
        resolve_mode,
        supported_tasks,
        token_counter,
    )
    from diffserve.protocol import STEP_MODE

    loaded = load_model(spec.model, spec.device, spec.dtype, spec.torch_threads, spec.index)
    family_cls = family_for(loaded.pipeline_class)
    family_name = family_cls.name if family_cls else None
    mode = resolve_mode(spec.batching_mode, family_name, loaded.pipeline_class)
    edits = edit_pipelines(loaded.pipe)
    family = family_cls(loaded.pipe, edits, loaded.call_kwargs) if family_cls else None
    info = model_info(loaded, spec.served_name, mode, family_name, supported_tasks(edits))
    count = token_counter(loaded.pipe)
    if mode == STEP_MODE:
        from diffserve.executor.step_engine import StepEngine

        loop = StepLoop(StepEngine(family, count), sock, spec.index)
    else:
        from diffserve.executor.request_runner import RequestRunner

        loop = RequestLoop(RequestRunner(loaded, edits, family, count), sock, spec.index)
    log.info("loaded %s (%s) on %s/%s, native %dx%d, %s mode, tasks: %s", spec.model,
             info.pipeline_class, info.device, info.dtype, info.width, info.height, mode,
             ", ".join(info.tasks))
    sock.send_multipart(encode(Kind.READY, info))
    return loop


def split_inputs(work: Work, frames: list[Any]) -> list[list[Any]]:
    """The input frames of each item (edits carry an image, inpainting a mask too)."""
    inputs, offset = [], 0
    for item in work.items:
        count = item.request.input_frames
        inputs.append(frames[offset:offset + count])
        offset += count
    if offset != len(frames):
        raise ProtocolError(f"work {work.work_id} carries {len(frames)} input frames, its items "
                            f"{offset}")
    return inputs


class _Loop:
    def __init__(self, sock: zmq.Socket, index: int) -> None:
        from diffserve.metrics import metrics

        self.sock = sock
        self.label = str(index)
        self.metrics = metrics()
        self.stopping = False

    def _receive(self, block: bool) -> tuple[Kind, Any, list[Any]] | None:
        try:
            frames = self.sock.recv_multipart(0 if block else zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            return decode(frames)
        except ProtocolError as error:
            log.error("dropped a malformed message from the scheduler: %s", error)
            return None

    def _send_outcomes(self, outcomes) -> None:
        if not outcomes:
            return
        results, frames = [], []
        for o in outcomes:
            results.append(ItemResult(o.item.request.request_id, o.item.start, o.item.stop,
                                      o.execution_s, o.error, o.prompt_tokens))
            if o.error is None:
                frames.extend(o.images)  # rows of a contiguous array: sent without a copy
        first = outcomes[0].item.request
        self.sock.send_multipart(encode(Kind.ITEMS_DONE, ItemsDone(first.width, first.height, results),
                                        frames), copy=False)
        self.metrics.images_generated_total.labels(executor=self.label).inc(len(frames))

    def _send_preview(self, preview) -> None:
        image = preview.image
        self.sock.send_multipart(encode(Kind.PARTIAL, Partial(
            preview.request_id, preview.index, preview.partial_index, image.shape[1],
            image.shape[0]), [image]), copy=False)
        self.metrics.partial_images_total.labels(executor=self.label).inc()


class RequestLoop(_Loop):
    """One work message at a time, one pipeline call each."""

    def __init__(self, runner, sock: zmq.Socket, index: int) -> None:
        super().__init__(sock, index)
        self.runner = runner
        self.running: set[str] = set()
        self.cancelled: set[str] = set()
        self.pending: list[tuple[Work, list[Any]]] = []
        runner.should_interrupt = self._should_interrupt
        runner.emit_preview = self._send_preview

    def run(self) -> None:
        while not self.stopping:
            if self.pending:
                self._execute(*self.pending.pop(0))
                continue
            message = self._receive(block=True)
            if message is not None:
                self._handle(*message)

    def _handle(self, kind: Kind, msg, frames) -> None:
        if kind is Kind.SHUTDOWN:
            self.stopping = True
        elif kind is Kind.CANCEL:
            self.cancelled.update(msg.request_ids)
        elif kind is Kind.WORK:
            if self.running:  # the scheduler sends work only to an idle executor; keep it
                log.error("work %d arrived during a call; it runs next", msg.work_id)
            self.pending.append((msg, frames))
        else:
            log.warning("executor ignored a %s message", kind.name)

    def _execute(self, work: Work, frames: list[Any]) -> None:
        self.running = {item.request.request_id for item in work.items}
        self.cancelled -= self.running  # a request id is never reused
        start = time.perf_counter()
        try:
            outcomes = self.runner.execute(work, split_inputs(work, frames))
        finally:
            self.running = set()
        elapsed = time.perf_counter() - start
        m = self.metrics
        m.batch_execution_seconds.labels(executor=self.label).observe(elapsed)
        m.executor_busy_seconds.labels(executor=self.label).inc(elapsed)
        if outcomes and all(o.status == CANCELLED_OUTCOME for o in outcomes):
            m.batches_interrupted_total.labels(executor=self.label).inc()
        self._send_outcomes(outcomes)

    def _should_interrupt(self) -> bool:
        while (message := self._receive(block=False)) is not None:
            self._handle(*message)
        return self.stopping or self.running <= self.cancelled


class StepLoop(_Loop):
    """The running set: admit and drop between steps, one step at a time."""

    def __init__(self, engine, sock: zmq.Socket, index: int) -> None:
        super().__init__(sock, index)
        self.engine = engine

    def run(self) -> None:
        m, label = self.metrics, self.label
        while not self.stopping:
            work = []
            message = self._receive(block=not self.engine)  # an empty set sleeps until work comes
            while message is not None:
                kind, msg, frames = message
                if kind is Kind.SHUTDOWN:
                    self.stopping = True
                elif kind is Kind.CANCEL:
                    self.engine.cancel(msg.request_ids)
                elif kind is Kind.WORK:
                    work.append((msg, frames))
                message = self._receive(block=False)
            if self.stopping:
                break
            if work:
                self._admit(work)
            if self.engine:
                out = self.engine.step()
                for preview in out.previews:
                    self._send_preview(preview)
                self._send_outcomes(out.finished)
                if out.images:
                    m.step_seconds.labels(executor=label).observe(out.seconds)
                    m.step_running_images.labels(executor=label).observe(out.images)
                m.executor_busy_seconds.labels(executor=label).inc(out.seconds)
                for o in out.finished:
                    m.step_retirements_total.labels(executor=label, outcome=o.status).inc()

    def _admit(self, work: list[tuple[Work, list[Any]]]) -> None:
        items, inputs = [], []
        for msg, frames in work:
            items.extend(msg.items)
            inputs.extend(split_inputs(msg, frames))
        start = time.perf_counter()
        failed = self.engine.admit(items, inputs)
        self.metrics.executor_busy_seconds.labels(executor=self.label).inc(time.perf_counter() - start)
        self.metrics.step_admissions_total.labels(executor=self.label).inc(len(items) - len(failed))
        self._send_outcomes(failed)
