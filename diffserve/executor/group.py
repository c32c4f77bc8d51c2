"""A parallel group's ranks kept in step: the leader plans, every rank runs the same step.

The group is one executor to the scheduler. Its leader (rank 0) runs the step loop: it receives
the work, cancels, pauses and adapter changes, plans each step (:class:`LeaderEngine`) and sends
every call that changes its step engine, in order, to the other ranks over a control socket each
(ZMQ PUSH, as vLLM's multiprocess executor broadcasts each step's scheduler output to its
workers). The other ranks (:func:`run_follower`) make the same calls on their own step engine:
the same admissions with the same inputs and seeds, the same plan, so the same batched forwards,
in which diffusers' collectives meet. Only the leader answers.

Every rank keeps its whole step engine (latents, schedulers, decodes): what a step computes is
deterministic given its inputs, so the ranks never need to exchange it. What a step decides from
values that differ by rank (the step cache's signal, computed on each rank's share of the
tokens) is reduced across the group first (:meth:`~diffserve.executor.parallel.Group.reduce_sums`).

A rank that dies takes the group down: the leader watches the others' process sentinels and
exits when one does (the scheduler then answers what the group held and starts it again), and
the others die with the leader (their parent). A rank that hangs fails its peers' next
collective after ``--collective-timeout-s``, with the same result.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
from dataclasses import dataclass
from typing import Any

import zmq

from diffserve import processes
from diffserve.config import ServerConfig
from diffserve.executor.parallel import RankSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FollowerSpec:
    config: ServerConfig
    rank: RankSpec
    control: str  # the leader's control socket for this rank
    torch_threads: int
    parent_pid: int


def rank_title(group: int, rank: int) -> str:
    return f"diffserve::executor-{group}.r{rank}"


def local_device(device: str) -> str:
    """A GPU rank sees only its own GPU (``CUDA_VISIBLE_DEVICES``, set before torch starts): it is
    ``cuda:0`` there, which is also the device diffusers picks for it (rank modulo the visible
    count would otherwise pick another rank's)."""
    if device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        return "cuda:0"
    return device


class Link:
    """The leader's control sockets, one per other rank."""

    def __init__(self, ctx: zmq.Context, count: int) -> None:
        import threading

        self.stopping = threading.Event()  # the group is being stopped: its ranks may exit
        self.directory = tempfile.mkdtemp(prefix="diffserve-group-")
        self.addresses = [f"ipc://{self.directory}/rank-{r}" for r in range(1, count + 1)]
        self.sockets = []
        for address in self.addresses:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
            self.sockets.append(sock)

    def send(self, op: str, *args: Any) -> None:
        payload = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self.sockets:
            sock.send(payload, copy=False)

    def close(self) -> None:
        """Tell the other ranks to stop (their exit is expected from now on)."""
        self.stopping.set()
        self.send("shutdown")


class LeaderEngine:
    """The leader's step engine: every call that changes the engine goes to the other ranks
    first, then runs here; a step's plan is made here and sent with it."""

    def __init__(self, engine, link: Link) -> None:
        self.engine, self.link = engine, link

    def __bool__(self) -> bool:
        return bool(self.engine)

    def __getattr__(self, name: str):  # what only reads the engine (its timer, its stages)
        return getattr(self.engine, name)

    def admit(self, items, inputs, arrived=None):
        # Input frames travel as arrays (a ZMQ frame is not picklable).
        import numpy as np

        self.link.send("admit", items, [[np.frombuffer(f, np.uint8) for f in frames]
                                        for frames in inputs])
        return self.engine.admit(items, inputs, arrived)

    def cancel(self, request_ids) -> None:
        self.link.send("cancel", list(request_ids))
        self.engine.cancel(request_ids)

    def pause(self, keys) -> None:
        self.link.send("pause", list(keys))
        self.engine.pause(keys)

    def step(self):
        plan = self.engine.plan()
        self.link.send("step", plan)
        return self.engine.step(plan)

    def abandon(self, error: str):
        self.link.send("abandon", error)
        return self.engine.abandon(error)


class _Silent:
    """What a follower answers to: nothing (the leader answers for the group)."""

    def answer_adapter(self, *args, **kwargs) -> None:
        pass

    def count_resident(self, adapters) -> None:
        pass


def run_follower(spec: FollowerSpec) -> None:
    """A rank other than the leader: join the group, load the model as the leader does, then make
    the leader's calls on its own step engine until told to stop (or the leader dies)."""
    processes.become(rank_title(spec.rank.group, spec.rank.rank), spec.parent_pid,
                     spec.config.log_level)
    device = local_device(spec.rank.device)
    from diffserve.executor.loading import leave_out_unused_libraries
    from diffserve.executor.parallel import Group
    from diffserve.executor.loops import apply_adapter_message
    from diffserve.executor.weights import run_step
    from diffserve.executor.process_setup import bound_openmp_spin, freeze_heap
    from diffserve.executor.runtime import build_runtime

    bound_openmp_spin()
    leave_out_unused_libraries(spec.config.serves_adapters, spec.config.quantization,
                               spec.config.text_encoder_quantization)
    group = Group(spec.rank)
    rt = build_runtime(spec.config, device, spec.torch_threads, spec.rank.group, group=group)
    engine = rt.step_engine()
    freeze_heap()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.connect(spec.control)
    silent = _Silent()
    try:
        while True:
            op, args = pickle.loads(sock.recv())
            if op == "shutdown":
                break
            if op == "admit":
                engine.admit(*args)
            elif op == "cancel":
                engine.cancel(*args)
            elif op == "pause":
                engine.pause(*args)
            elif op == "step":
                engine.step(*args)
            elif op == "abandon":
                engine.abandon(*args)
            elif op == "adapter":
                apply_adapter_message(rt.adapters, silent, *args)
            elif op == "weights":
                # A refusal (the update does not fit) is every rank's, as the leader answers it;
                # a rank that fails otherwise takes its group down, to restart in step.
                result = run_step(rt.weights, *args)
                if result.status >= 500:
                    raise RuntimeError(f"rank {spec.rank} could not apply weights: {result.error}")
    finally:
        ctx.destroy(linger=0)
        group.close()


def start_group(config: ServerConfig, index: int, devices: str, torch_threads: int):
    """The leader's side of starting group ``index`` over ``devices`` (comma-separated, one per
    rank): the model checked for what the group asks of it, the other ranks started (named in
    ``ps``), and this process joined to them. Returns (this rank's device, the group, the control
    link, the other ranks' processes)."""
    from diffserve.executor.parallel import Degrees, Group, check_model
    from diffserve.launcher import free_port
    from diffserve.models.registry import resolve_model

    devices = devices.split(",")
    device = local_device(devices[0])  # before CUDA starts
    check_model(config, resolve_model(config.model), devices[0])
    degrees = Degrees.of(config)
    port = free_port()
    spec = lambda rank: RankSpec(index, rank, degrees, tuple(devices), port,  # noqa: E731
                                 config.collective_timeout_s)
    link = Link(zmq.Context.instance(), degrees.size - 1)
    followers = [processes.start(run_follower, FollowerSpec(config, spec(rank),
                                                            link.addresses[rank - 1],
                                                            torch_threads, os.getpid()),
                                 rank_title(index, rank))
                 for rank in range(1, degrees.size)]
    watch(followers, link)
    return device, Group(spec(0)), link, followers


def watch(followers, link: Link) -> None:
    """The leader exits as soon as another rank of its group does, whatever it is doing then
    (joining the group, loading, waiting for work, in a collective), unless the group is being
    stopped: the group is useless without it, and the scheduler answers what it held and starts
    the group again."""
    import threading
    from multiprocessing.connection import wait

    def wait_for_one() -> None:
        (gone,) = wait([p.sentinel for p in followers])[:1]
        if link.stopping.is_set():
            return
        dead = next(p for p in followers if p.sentinel == gone)
        log.error("rank %s of this parallel group exited (exit code %s): the group restarts",
                  dead.name, dead.exitcode)
        os._exit(1)

    threading.Thread(target=wait_for_one, name="group-watch", daemon=True).start()


