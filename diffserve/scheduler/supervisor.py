"""Executor supervision: start one executor process per device, restart the one that dies, and
give up on one that keeps dying before its model loads.

Knows processes, not requests: what a dead executor held is the scheduler core's business.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from diffserve import processes
from diffserve.wire.protocol import ExecutorState

log = logging.getLogger(__name__)

# An executor that dies this many times in a row before loading its model will not get better.
MAX_FAILED_STARTS = 3

STARTING, READY, RESTARTING, FAILED, STOPPED = "starting", "ready", "restarting", "failed", "stopped"


@dataclass
class _Executor:
    index: int
    device: str  # as its process reports it once loaded (auto resolved)
    process: Any = None
    generation: int = 0  # bumped at every start: tells a new process's messages from an old one's
    state: str = STARTING
    restarts: int = 0
    failed_starts: int = 0
    launch_device: str = ""  # as configured: every start gets it (a group's, one per rank)

    def __post_init__(self) -> None:
        self.launch_device = self.launch_device or self.device

    @property
    def identity(self) -> bytes:
        return f"{self.index}:{self.generation}".encode()


@dataclass(frozen=True)
class Death:
    """What happened when an executor exited."""

    index: int
    exit_code: int | None
    was_ready: bool
    restarted: bool  # False: it failed too often and stays down


class ExecutorSupervisor:
    def __init__(self, devices: list[str], start: Callable[[int, str, bytes], Any]) -> None:
        """``start(index, device, identity)`` starts one executor process and returns it."""
        self._start = start
        self.executors = [_Executor(i, device) for i, device in enumerate(devices)]

    def start_all(self) -> None:
        for ex in self.executors:
            self._launch(ex)

    def _launch(self, ex: _Executor) -> None:
        ex.generation += 1
        ex.process = self._start(ex.index, ex.launch_device, ex.identity)
        log.info("started executor %d (%s) pid %d", ex.index, ex.launch_device, ex.process.pid)

    def index_of(self, identity: bytes) -> int | None:
        """The executor that sent a message, if it is the current process of its slot."""
        for ex in self.executors:
            if ex.identity == identity and ex.state != FAILED:
                return ex.index
        return None

    def identity(self, index: int) -> bytes:
        return self.executors[index].identity

    def sentinels(self) -> dict[int, int]:
        """Process sentinel -> executor index, for every executor process that is running."""
        return {ex.process.sentinel: ex.index for ex in self.executors
                if ex.process is not None and ex.state not in (FAILED, STOPPED)}

    def loaded(self, index: int, device: str) -> None:
        ex = self.executors[index]
        ex.state, ex.failed_starts, ex.device = READY, 0, device

    def died(self, index: int, restart: bool = True) -> Death:
        """Reap a dead executor and start another, unless it keeps failing before it loads or
        ``restart`` is False (the server is giving up anyway)."""
        ex = self.executors[index]
        ex.process.join()
        code = ex.process.exitcode
        was_ready = ex.state == READY
        ex.failed_starts = 0 if was_ready else ex.failed_starts + 1
        log.error("executor %d pid %d died with exit code %s", index, ex.process.pid, code)
        if not restart or ex.failed_starts >= MAX_FAILED_STARTS:
            ex.state = FAILED
            if restart:
                log.error("executor %d died %d times before loading its model; not restarting "
                          "it", index, ex.failed_starts)
            return Death(index, code, was_ready, restarted=False)
        ex.state, ex.restarts = RESTARTING, ex.restarts + 1
        self._launch(ex)
        return Death(index, code, was_ready, restarted=True)

    def fail(self, index: int) -> None:
        """Give up on an executor (it reported that it cannot load the model)."""
        ex = self.executors[index]
        ex.state = FAILED
        if ex.process is not None:
            processes.stop(ex.process)

    def all_failed(self) -> bool:
        return all(ex.state == FAILED for ex in self.executors)

    def states(self) -> list[ExecutorState]:
        return [ExecutorState(ex.index, ex.state, ex.device,
                              ex.process.pid if ex.process is not None else None, ex.restarts)
                for ex in self.executors]

    def kill_all(self) -> None:
        """Stop every executor at once (the scheduler is failing)."""
        for ex in self.executors:
            if ex.process is not None:
                processes.kill(ex.process)
            ex.state = STOPPED

    def stop_all(self, ask: Callable[[int], None], timeout_s: float = 5.0) -> None:
        """``ask(index)`` sends a serving executor its shutdown message; then each gets
        ``timeout_s`` before it is killed. One still loading its model holds no work and reads no
        message until it has loaded (minutes, for a large model): it is killed at once."""
        running = [ex for ex in self.executors if ex.process is not None and ex.process.is_alive()]
        for ex in [ex for ex in running if ex.state != READY]:
            processes.kill(ex.process)
            ex.state = STOPPED
        running = [ex for ex in running if ex.state == READY]
        for ex in running:
            ask(ex.index)
        for ex in running:
            ex.process.join(timeout_s)
            processes.stop(ex.process)
            ex.state = STOPPED
