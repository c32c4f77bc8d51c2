"""Executor process: IO around the model runner.

Receives one batch at a time from the scheduler, runs it on the thread that loaded the model,
and sends the images back as raw buffers.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

import zmq

from diffserve import processes
from diffserve.protocol import Fatal, Kind, decode, encode

log = logging.getLogger(__name__)


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
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(spec.batch_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 5000)
    outbox.connect(spec.result_addr)
    try:
        from diffserve.executor.runner import ModelRunner
        from diffserve.metrics import metrics

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
    m = metrics()
    outbox.send_multipart(encode(Kind.READY, runner.info))
    while True:
        kind, batch, _ = decode(inbox.recv_multipart())
        if kind is Kind.SHUTDOWN:
            break
        if kind is not Kind.BATCH:
            log.warning("executor ignored a %s message", kind.name)
            continue
        result, images = runner.execute(batch)
        m.batch_execution_seconds.observe(result.execution_time_s)
        m.images_generated_total.inc(len(images))
        # numpy arrays expose the buffer protocol: ZMQ sends their memory without a copy.
        outbox.send_multipart(encode(Kind.BATCH_RESULT, result, images), copy=False)
    outbox.close()
    inbox.close()
    ctx.term()
