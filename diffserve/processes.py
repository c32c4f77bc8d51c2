"""Starting and supervising the server's processes.

Each process is one entry function taking one frozen spec, started with the spawn method (no
forked torch or ZMQ state), named in ``ps`` and tied to its parent's life: the kernel signals
it when the parent dies, so a killed server leaves no orphans.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import signal
import sys
from typing import Any, Callable

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def start(target: Callable[[Any], None], spec: Any, name: str) -> multiprocessing.process.BaseProcess:
    ctx = multiprocessing.get_context("spawn")
    # Not daemonic: the scheduler must be able to start the executor itself.
    process = ctx.Process(target=target, args=(spec,), name=name, daemon=False)
    process.start()
    return process


def become(title: str, parent_pid: int, log_level: str = "info") -> None:
    """First call in a child: set its name, die with its parent, set up logging."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # pragma: no cover - declared dependency
        pass
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)
    # Ctrl-C and `kill -TERM -<group>` (systemd's default stop) reach the whole process group;
    # only the frontend decides how to stop: it drains, then tells its children to stop, and
    # they die with it if it dies first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_level, title)


def configure_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(name)s: %(message)s")


def stop(process: multiprocessing.process.BaseProcess, timeout: float = 5.0) -> None:
    """Give a child that was asked to stop (by message) ``timeout`` to exit, then kill it. It
    ignores SIGTERM, which the whole process group may get while the frontend still drains."""
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(timeout)


def kill(process: multiprocessing.process.BaseProcess, timeout: float = 5.0) -> None:
    """Stop a child now."""
    if process.is_alive():
        process.kill()
    process.join(timeout)


def stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker and wait for it. The spawn method starts it on
    first use and it would otherwise outlive the server by a moment, as a stray process. Call
    once every child has exited (they hold it open too)."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker  # the module's one instance
    try:
        tracker._stop()  # closes its pipe and waits for it to exit
    except (OSError, ChildProcessError):
        pass


# -- what every executor process (and every rank of a parallel group) does as it starts --

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


def freeze_heap() -> None:
    """Keep what loading made (the model's modules, the libraries' objects: about a million)
    out of the garbage collector's full passes: a full pass over them took 200-300 ms, a pause
    of the step loop every few seconds of serving; what the loop makes later is still
    collected. The collector, off while loading (run_executor), is on again from here."""
    gc.collect()
    gc.freeze()
    gc.enable()
