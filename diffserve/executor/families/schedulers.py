"""A request's own noise scheduler inside its pipeline's helpers: the pipelines' helpers
(``prepare_latents``, ``get_timesteps``...) read ``self.scheduler``, so a request's scheduler is
swapped in for the duration of each call, under a lock that plain pipeline calls take too."""

from __future__ import annotations

import threading
from contextlib import contextmanager


# Held while a pipeline's scheduler is swapped (an encode stage preparing a request) and for a
# whole plain pipeline call (a request-mode task's, on the step loop), which reads it.
PIPELINE_LOCK = threading.RLock()


@contextmanager
def scheduler_swapped(pipe, scheduler):
    """``pipe`` with ``scheduler`` in place of its own, for one helper call. Bypasses the
    pipeline's ``__setattr__``, which would rewrite its config on every swap."""
    with PIPELINE_LOCK:
        saved = pipe.__dict__["scheduler"]
        object.__setattr__(pipe, "scheduler", scheduler)
        try:
            yield pipe
        finally:
            object.__setattr__(pipe, "scheduler", saved)
