"""How long the tests' waits may be on this machine: every upper bound on an event the suite
waits for (a server's start and stop, a metric, an HTTP answer) is a figure for the 2-core machine
the suite was written on, times :func:`scale`.

The scale is this machine's pace against that one: a fixed pure-Python loop's best time over a
few runs (the interpreter's speed; model code follows it within a small factor), times how many
fewer than two cores this process may use (``taskset -c 0`` halves a 2-core machine). It is never
below 1: a faster machine keeps the written bounds. ``DIFFSERVE_TEST_TIME_SCALE`` overrides it."""

from __future__ import annotations

import os
import time
from functools import cache

REFERENCE_S = 0.065  # the loop below on the machine the bounds were written for (2 vCPU, AMD EPYC)
REFERENCE_CORES = 2


def _loop_s(n: int = 2_000_000) -> float:
    start, total = time.perf_counter(), 0
    for i in range(n):
        total += i * i
    return time.perf_counter() - start


@cache
def scale() -> float:
    given = os.environ.get("DIFFSERVE_TEST_TIME_SCALE")
    if given:
        return float(given)
    speed = min(_loop_s() for _ in range(3)) / REFERENCE_S
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1.0, speed) * max(1.0, REFERENCE_CORES / max(1, cores or 1))


def scaled(seconds: float) -> float:
    """``seconds`` on the reference machine, as a bound on this one."""
    return seconds * scale()
