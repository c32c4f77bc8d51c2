"""A step's time as the device spent it, read without stalling the device.

On a GPU, work is queued: ``perf_counter`` around a forward measures its launch, and the forward
itself is charged to whichever later step first waits for the GPU (often another running set's),
which misleads the time-fair set choice, ``diffserve_step_seconds`` and the busy share. So on
CUDA a step (a lap) is bracketed by CUDA events, and so is each span of interest inside it (the
denoiser, the VAE). Waiting for the device at the end of every step to read them would leave the
GPU idle while the host plans the next step; instead a lap's events are read once a later lap
has been queued (:meth:`StepTimer.collect` with ``keep=1``): by then the device has usually
finished the earlier one, and the host runs a step ahead of it. A lap's owner learns its time
through the lap's ``done`` callback, a step late. When the loop has nothing more to queue, it
collects every lap (``keep=0``), which waits for the device once.

On the CPU the work is done when the call returns: a lap's time is the clock around it, known
at once.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from diffserve.device import of
from diffserve.device.stats import synced_clock


@dataclass
class Lap:
    """One timed stretch of device work (a step, an admission)."""

    done: Callable[[float, float], None]  # called with (seconds, seconds inside its spans)
    start: Any = None  # the device's event (queued work), or the clock's reading
    end: Any = None
    spans: list = field(default_factory=list)  # (start, end) events, where work is queued
    inner: float = 0.0  # seconds in spans, on the CPU


class StepTimer:
    def __init__(self, torch, device, clock: Callable[[], float]) -> None:
        self.torch = torch
        self.device = torch.device(device)
        self.kind = of(self.device)
        self.queued = self.kind.queued  # CUDA: time the work with events
        self.clock = clock
        self._lap: Lap | None = None  # the lap being queued
        self._pending: list[Lap] = []  # queued laps whose events are not read yet (CUDA)

    def _event(self):
        event = self.kind.event(timing=True)
        event.record()
        return event

    def begin(self, done: Callable[[float, float], None]) -> None:
        """Start a lap; ``done(seconds, inner)`` is called once its time is known."""
        self._lap = Lap(done, self._event() if self.queued else self.clock())

    def end(self, keep: int = 1) -> None:
        """End the lap begun last, then :meth:`collect` all but the ``keep`` newest laps."""
        lap, self._lap = self._lap, None
        if self.queued:
            lap.end = self._event()
            self._pending.append(lap)
            self.collect(keep)
        else:
            lap.done(self.clock() - lap.start, lap.inner)

    def collect(self, keep: int = 0) -> None:
        """Read the time of every queued lap but the ``keep`` newest (waiting for the device
        where it has not finished them) and tell their owners, oldest first."""
        while len(self._pending) > keep:
            lap = self._pending.pop(0)
            lap.end.synchronize()
            inner = sum(s.elapsed_time(e) for s, e in lap.spans) / 1000.0
            lap.done(lap.start.elapsed_time(lap.end) / 1000.0, inner)

    @contextmanager
    def span(self):
        """Time spent in the block counts as the lap's device work (the denoiser, the VAE); a
        span outside any lap counts nowhere."""
        lap = self._lap
        if lap is None:
            yield
            return
        if self.queued:
            start = self._event()
            try:
                yield
            finally:
                lap.spans.append((start, self._event()))
            return
        began = self.clock()
        try:
            yield
        finally:
            lap.inner += self.clock() - began

    def done(self) -> float:
        """Wait for the device to finish what was queued (on CUDA), then read the clock."""
        return synced_clock(self.device, self.clock)
