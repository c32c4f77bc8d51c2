"""Executor process: IO around one of the two engines.

It connects a DEALER socket to the scheduler's ROUTER under its identity (``index:generation``)
and a PUSH socket to the frontend, loads the model (as the leader of a parallel group, with the
group's other ranks: :mod:`diffserve.executor.parallel.ranks`), says READY (with the batching mode it will
run), and runs one of the loops of :mod:`diffserve.executor.loops`.

Pixels (finished images, previews) go straight to the frontend; the scheduler gets only each
item's result header, sent after its images.
"""

from __future__ import annotations

import gc
import logging
import traceback
from dataclasses import dataclass

import zmq

from diffserve import metrics, processes
from diffserve.config.flags import ConfigError, ServerConfig
from diffserve.executor.sockets import ExecutorSockets
from diffserve.executor.loops import RequestLoop, StepLoop, apply_adapter_message
from diffserve.executor.memory.layout import kind_of
from diffserve.processes import bound_openmp_spin, freeze_heap
from diffserve.wire.protocol import Fatal, Kind, encode

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ExecutorSpec:
    config: ServerConfig
    index: int
    device: str
    torch_threads: int
    scheduler_addr: str  # the scheduler's ROUTER
    identity: bytes      # this process's address there
    frontend_addr: str   # where images and previews go
    metrics_dir: str
    parent_pid: int


def run_executor(spec: ExecutorSpec) -> None:
    # No cyclic collection while torch and diffusers import and the model loads: those passes
    # walk the same few hundred thousand new, long-lived objects again and again (about a
    # fifth of the start's CPU). freeze_heap collects once and turns it back on.
    gc.disable()
    title = (f"diffserve::executor-{spec.index}" if spec.config.degrees.size == 1
             else f"diffserve::executor-{spec.index}.r0")  # a parallel group's leader
    processes.become(title, spec.parent_pid, spec.config.log_level)
    metrics.record_to(spec.metrics_dir)
    counts = metrics.ProcessMetrics()
    bound_openmp_spin()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, spec.identity)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(spec.scheduler_addr)
    pixels = ctx.socket(zmq.PUSH)
    pixels.setsockopt(zmq.LINGER, 5000)
    pixels.connect(spec.frontend_addr)
    try:
        loop = build_loop(spec, ExecutorSockets(sock, pixels, spec.index, counts))
    except Exception as error:  # noqa: BLE001 - reported to the operator, then exit
        model = spec.config.model
        if isinstance(error, ConfigError):  # a setting this model or machine cannot serve
            log.error("could not serve model %r: %s", model, error)
        else:
            log.error("could not load model %r:\n%s", model, traceback.format_exc())
        sock.send_multipart(encode(Kind.FATAL, Fatal(f"could not load model {model!r}: "
                                                     f"{type(error).__name__}: {error}")))
        ctx.destroy(linger=5000)
        raise SystemExit(1)
    loop.run()
    ctx.destroy(linger=5000)


def build_loop(spec: ExecutorSpec, io: ExecutorSockets):
    """Load the model, pick the engine, say READY; the loop that serves it."""
    from diffserve.executor.accel.flops import counter_for
    from diffserve.executor.model.loading import leave_out_unused_libraries
    from diffserve.executor.runtime import build_runtime
    from diffserve.wire.protocol import REQUEST_MODE, STEP_MODE

    leave_out_unused_libraries(spec.config.serves_adapters, spec.config.quantization,
                               spec.config.text_encoder_quantization)
    group = link = None
    device = spec.device
    if spec.config.degrees.size > 1:  # a parallel group: this is its leader, rank 0
        from diffserve.executor.parallel.ranks import LeaderEngine, start_group

        device, group, link, _ = start_group(spec.config, spec.index, spec.device,
                                             spec.torch_threads, run_follower)
    rt = build_runtime(spec.config, device, spec.torch_threads, spec.index,
                       io.count_adapter_event, group=group)
    freeze_heap()
    if rt.mode == STEP_MODE:
        # What the start-up check sent to request mode runs as whole calls between two steps.
        calls = REQUEST_MODE in rt.task_modes.values()
        # The host plans the next step while the device runs this one: times read a step late.
        engine = rt.step_engine(stages=rt.threaded_stages, defer_timing=True)
        loop = StepLoop(engine if link is None else LeaderEngine(engine, link), io, rt.adapters,
                        RequestLoop(rt.request_runner, io, rt.adapters, nested=True)
                        if calls else None,
                        lambda request: rt.info.mode_of(request.mode_key) == REQUEST_MODE,
                        link, rt.weights)
    else:
        loop = RequestLoop(rt.request_runner, io, rt.adapters, weights=rt.weights)
    io.watch_compiles(rt.compiled)
    io.watch_flops(*counter_for(rt, spec.config))
    info = rt.info
    stages = ("" if rt.mode != STEP_MODE else
              ", encode and decode stages " + ("on" if rt.threaded_stages else "off (on the loop)"))
    log.info("loaded %s (%s) on %s/%s, native %dx%d, %s mode%s, tasks: %s", spec.config.model,
             info.pipeline_class, info.device, info.dtype, info.width, info.height, rt.mode,
             stages, ", ".join(f"{task} ({mode})" for task, mode in info.task_modes.items()))
    offloaded = {kind for kind in spec.config.offloaded}
    log.info("components: %s", ", ".join(
        f"{c.name} on {c.device}{' (offloaded)' if kind_of(c.name) in offloaded else ''} "
        f"{c.dtype} {c.bytes / 1e6:.1f} MB" for c in info.components if c.rank == 0))
    io.set_memory(info)
    io.sock.send_multipart(encode(Kind.READY, info))
    return loop


def run_follower(spec) -> None:
    """A rank of a parallel group other than its leader (a
    :class:`~diffserve.executor.parallel.ranks.FollowerSpec`): join the group, load the model as
    the leader does, then make the leader's calls on its own step engine until told to stop (or
    the leader dies)."""
    from diffserve.executor.parallel.topology import rank_title

    processes.become(rank_title(spec.rank.group, spec.rank.rank), spec.parent_pid,
                     spec.config.log_level)
    device = spec.rank.device  # inside the operator's visible set, made current as it loads
    bound_openmp_spin()
    from diffserve.executor.model.loading import leave_out_unused_libraries

    leave_out_unused_libraries(spec.config.serves_adapters, spec.config.quantization,
                               spec.config.text_encoder_quantization)
    from diffserve.executor.parallel.ranks import follow
    from diffserve.executor.parallel.topology import Group
    from diffserve.executor.rl.weights import run_step
    from diffserve.executor.runtime import build_runtime

    group = Group(spec.rank)
    rt = build_runtime(spec.config, device, spec.torch_threads, spec.rank.group, group=group)
    engine = rt.step_engine()
    freeze_heap()
    silent = _Silent()

    def on_weights(step) -> None:
        # A refusal (the update does not fit) is every rank's, as the leader answers it; a rank
        # that fails otherwise takes its group down, to restart in step.
        result = run_step(rt.weights, step)
        if result.status >= 500:
            raise RuntimeError(f"rank {spec.rank.rank} could not apply weights: {result.error}")

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.connect(spec.control)
    try:
        follow(sock, engine, lambda kind, msg: apply_adapter_message(rt.adapters, silent, kind, msg),
               on_weights)
    finally:
        ctx.destroy(linger=0)
        group.close()


class _Silent:
    """What a follower answers to: nothing (the leader answers for the group)."""

    def answer_adapter(self, *args, **kwargs) -> None:
        pass

    def count_resident(self, adapters) -> None:
        pass
