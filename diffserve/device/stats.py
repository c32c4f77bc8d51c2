"""A device's clock and memory statistics, for what measures on it (``diffserve calibrate``, the
memory budget, the step timer's end of a step)."""

from __future__ import annotations

import time
from typing import Callable

from diffserve.device import of


def synced_clock(device, clock: Callable[[], float] = time.perf_counter) -> float:
    """``clock()`` once ``device`` has done what was queued on it (on a device with queued work,
    after a synchronisation; elsewhere work is done when its call returns). The one way diffserve
    reads the time of device work as a whole."""
    kind = of(device)
    if kind.queued:
        kind.synchronize(device)
    return clock()


class DeviceStats:
    """The measured device's synchronisation and memory statistics, each call naming that device.
    ``counted`` is False where the kind counts no memory (the CPU): then every answer is None."""

    def __init__(self, device) -> None:
        import torch

        self.device = torch.device(device)
        self.kind = of(self.device)
        self.counted = self.kind.queued

    def start(self) -> int | None:
        """Wait for the device, reset its peak; the bytes allocated now."""
        if not self.counted:
            return None
        self.kind.synchronize(self.device)
        self.kind.reset_peak(self.device)
        return self.kind.allocated(self.device)

    def done(self) -> float:
        """The clock, once the device has done what was queued."""
        return synced_clock(self.device)

    def allocated(self) -> int | None:
        return self.kind.allocated(self.device) if self.counted else None

    def peak(self, base: int | None) -> int | None:
        return self.kind.peak_allocated(self.device) - base if self.counted else None

    def free(self) -> int | None:
        if not self.counted:
            return None
        return self.kind.free_total(self.device)[0]

    def unfreed(self) -> int | None:
        """Bytes the allocator keeps reserved beyond what is allocated once its free cache is
        returned: private pools (CUDA graphs') that emptying the cache cannot release."""
        if not self.counted:
            return None
        self.kind.synchronize(self.device)
        self.kind.empty_cache()
        return self.kind.reserved(self.device) - self.kind.allocated(self.device)
