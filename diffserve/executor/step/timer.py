"""A step's time as the device spent it.

On a GPU, work is queued: ``perf_counter`` around a forward measures its launch, and the forward
itself is charged to whichever later step first waits for the GPU (often another running set's),
which misleads the time-fair set choice, ``diffserve_step_seconds`` and the busy share. So on
CUDA each span of interest (the denoiser, the VAE) is bracketed by CUDA events, no
synchronisation inside the step; at the end of the step the host waits for the device once and
only then reads the clock and the events. On the CPU the work is done when the call returns, and
the clock is read as it is.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

from diffserve.executor.model.device_stats import synced_clock


class StepTimer:
    def __init__(self, torch, device, clock: Callable[[], float]) -> None:
        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.clock = clock
        self._spans: list = []  # (start, end) events of this step, on CUDA
        self._inner = 0.0  # seconds in spans, on the CPU

    @contextmanager
    def span(self):
        """Time spent in the block counts as the step's device work (the denoiser, the VAE)."""
        if self.cuda:
            start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            try:
                yield
            finally:
                end.record()
                self._spans.append((start, end))
            return
        began = self.clock()
        try:
            yield
        finally:
            self._inner += self.clock() - began

    def done(self) -> float:
        """Wait for the device to finish what was queued (on CUDA), then read the clock."""
        return synced_clock(self.torch, self.device, self.clock)

    def take_inner(self) -> float:
        """Seconds the spans took since the last call (after :meth:`done`)."""
        inner = self._inner + sum(start.elapsed_time(end) for start, end in self._spans) / 1000.0
        self._inner, self._spans = 0.0, []
        return inner
