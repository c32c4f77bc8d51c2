"""Executor process: IO around the model runner.

Receives one batch at a time from the scheduler, runs it on the thread that loaded the model,
and sends the images back as raw buffers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import traceback
from dataclasses import dataclass

import zmq

from diffserve import processes
from diffserve.protocol import Fatal, Kind, decode, encode

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
    device: str
    dtype: str
    torch_threads: int
    batch_addr: str   # PULL: batches from the scheduler
    result_addr: str  # PUSH: results to the scheduler
    parent_pid: int
    log_level: str = "info"


def run_executor(spec: ExecutorSpec) -> None:
    processes.become("diffserve::executor", spec.parent_pid, spec.log_level)
    bound_openmp_spin()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(spec.batch_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 5000)
    outbox.connect(spec.result_addr)
    try:
        from diffserve.executor.runner import ModelRunner

        runner = ModelRunner(spec.model, spec.served_name, spec.device, spec.dtype,
                             spec.torch_threads)
    except Exception as error:  # noqa: BLE001 - reported to the operator, then exit
        log.error("could not load model %r:\n%s", spec.model, traceback.format_exc())
        outbox.send_multipart(encode(Kind.FATAL, Fatal(f"could not load model {spec.model!r}: "
                                                       f"{type(error).__name__}: {error}")))
        outbox.close()
        ctx.term()
        raise SystemExit(1)
    log.info("loaded %s (%s) on %s/%s, native %dx%d", spec.model, runner.info.pipeline_class,
             runner.info.device, runner.info.dtype, runner.info.width, runner.info.height)
    outbox.send_multipart(encode(Kind.READY, runner.info))
    ExecutorLoop(runner, inbox, outbox).run()
    outbox.close()
    inbox.close()
    ctx.term()


class ExecutorLoop:
    """One batch at a time. While a batch runs, the pipeline's step callback peeks at the inbox,
    so a batch whose callers have all gone stops at the next denoising step."""

    def __init__(self, runner, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        from diffserve.metrics import metrics

        self.runner, self.inbox, self.outbox = runner, inbox, outbox
        self.metrics = metrics()
        self.running_id: int | None = None
        self.cancelled = False
        self.stopping = False
        runner.should_interrupt = self._should_interrupt

    def run(self) -> None:
        while not self.stopping:
            self._handle(*decode(self.inbox.recv_multipart())[:2])

    def _handle(self, kind: Kind, msg) -> None:
        if kind is Kind.SHUTDOWN:
            self.stopping = True
        elif kind is Kind.CANCEL_BATCH:
            self.cancelled = self.cancelled or msg.batch_id == self.running_id
        elif kind is Kind.BATCH and self.running_id is None:
            self._execute(msg)
        else:
            log.warning("executor ignored a %s message", kind.name)

    def _execute(self, batch) -> None:
        self.running_id, self.cancelled = batch.batch_id, False
        try:
            result, images = self.runner.execute(batch)
        finally:
            self.running_id = None
        self.metrics.batch_execution_seconds.observe(result.execution_time_s)
        if self.cancelled:
            self.metrics.batches_interrupted_total.inc()
            result = dataclasses.replace(result, images=[], errors={
                s.request_id: "cancelled: the client went away" for s in batch.samples})
            images = []
        self.metrics.images_generated_total.inc(len(images))
        # numpy arrays expose the buffer protocol: ZMQ sends their memory without a copy.
        self.outbox.send_multipart(encode(Kind.BATCH_RESULT, result, images), copy=False)

    def _should_interrupt(self) -> bool:
        while self.inbox.poll(0):
            kind, msg, _ = decode(self.inbox.recv_multipart())
            if kind is Kind.BATCH:
                log.error("executor got a batch while busy; dropping it")
            else:
                self._handle(kind, msg)
        return self.cancelled
