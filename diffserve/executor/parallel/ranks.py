"""A parallel group's ranks kept in step: the leader plans, every rank runs the same step.

The group is one executor to the scheduler. Its leader (rank 0) runs the step loop: it receives
the work, cancels, pauses and adapter changes, plans each step (:class:`LeaderEngine`) and sends
every call that changes its step engine, in order, to the other ranks over a control socket each
(ZMQ PUSH, as vLLM's multiprocess executor broadcasts each step's scheduler output to its
workers). The other ranks (:func:`follow`) make the same calls on their own step engine:
the same admissions with the same inputs and seeds, the same plan, so the same batched forwards,
in which diffusers' collectives meet. Only the leader answers.

Every rank keeps its whole step engine (latents, schedulers, decodes): what a step computes is
deterministic given its inputs, so the ranks never need to exchange it. What a step decides from
values that differ by rank (the step cache's signal, computed on each rank's share of the
tokens) is reduced across the group first (:meth:`~diffserve.executor.parallel.topology.Group.reduce_sums`).

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
from diffserve.config.flags import ServerConfig
from diffserve.executor.parallel.model import check_model
from diffserve.executor.parallel.topology import Group, RankSpec, rank_title
from diffserve.ports import free_port
from diffserve.builders.registry import resolve_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FollowerSpec:
    config: ServerConfig
    rank: RankSpec
    control: str  # the leader's control socket for this rank
    torch_threads: int
    parent_pid: int


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
        """Every rank admits ``items`` with the arrival times the leader reads off its own clock
        (the planner's choices read them)."""
        import numpy as np

        now = self.engine.clock()
        arrived = {item.request.request_id: now - item.queued_s for item in items} | (arrived or {})
        # Input frames travel as arrays (a ZMQ frame is not picklable).
        self.link.send("admit", items, [[np.frombuffer(f, np.uint8) for f in frames]
                                        for frames in inputs], arrived)
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


def follow(sock, engine, on_adapter, on_weights) -> None:
    """A follower's loop: the leader's calls, in order, made on ``engine`` until it says stop;
    ``on_adapter(kind, message)`` and ``on_weights(step)`` apply adapter changes and weight steps
    (the leader answers them; a follower only keeps in step)."""
    while True:
        op, args = pickle.loads(sock.recv())
        if op == "shutdown":
            return
        if op == "adapter":
            on_adapter(*args)
        elif op == "weights":
            on_weights(*args)
        elif op in ("admit", "cancel", "pause", "step", "abandon"):
            getattr(engine, op)(*args)
        else:
            raise RuntimeError(f"a follower got an unknown call {op!r} from its leader")


def start_group(config: ServerConfig, index: int, devices: str, torch_threads: int, entry):
    """The leader's side of starting group ``index`` over ``devices`` (comma-separated, one per
    rank): the model checked for what the group asks of it, the other ranks started with
    ``entry(FollowerSpec)`` (named in ``ps``), and this process joined to them. Returns (this
    rank's device, the group, the control link, the other ranks' processes)."""
    devices = devices.split(",")
    device = devices[0]
    check_model(config, resolve_model(config.model), devices[0])
    degrees = config.degrees
    port = free_port()
    spec = lambda rank: RankSpec(index, rank, degrees, tuple(devices), port,  # noqa: E731
                                 config.collective_timeout_s)
    link = Link(zmq.Context.instance(), degrees.size - 1)
    followers = [processes.start(entry, FollowerSpec(config, spec(rank), link.addresses[rank - 1],
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


