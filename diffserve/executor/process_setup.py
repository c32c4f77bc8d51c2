"""What every executor process (and every rank of a parallel group) does as it starts."""

from __future__ import annotations

import gc
import logging
import os
import sys

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


def freeze_heap() -> None:
    """Keep what loading made (the model's modules, the libraries' objects: about a million)
    out of the garbage collector's full passes: a full pass over them took 200-300 ms, a pause
    of the step loop every few seconds of serving; what the loop makes later is still
    collected. The collector, off while loading (run_executor), is on again from here."""
    gc.collect()
    gc.freeze()
    gc.enable()
