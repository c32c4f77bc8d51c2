"""A device's synchronisation and memory statistics, for what measures on it (``diffserve
calibrate``, the memory budget)."""

from __future__ import annotations

import time
from typing import Callable


def synced_clock(torch, device, clock: Callable[[], float] = time.perf_counter) -> float:
    """``clock()`` once ``device`` has done what was queued on it (on a CUDA device, after a
    synchronisation; elsewhere work is done when its call returns). The one way diffserve reads
    the time of device work as a whole: the step timer's end of a step, the measurements."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock()


class DeviceStats:
    """The measured device's synchronisation and memory statistics, each call naming that device
    (a CUDA call without one reads the current device, GPU 0 unless set). No-ops on the CPU."""

    def __init__(self, torch, device: str) -> None:
        self.torch, self.device = torch, torch.device(device)
        self.cuda = self.device.type == "cuda"

    def start(self) -> int | None:
        """Wait for the device, reset its peak; the bytes allocated now."""
        if not self.cuda:
            return None
        cuda = self.torch.cuda
        cuda.synchronize(self.device)
        cuda.reset_peak_memory_stats(self.device)
        return cuda.memory_allocated(self.device)

    def done(self) -> float:
        """The clock, once the device has done what was queued."""
        return synced_clock(self.torch, self.device)

    def peak(self, base: int | None) -> int | None:
        return self.torch.cuda.max_memory_allocated(self.device) - base if self.cuda else None

    def free(self) -> int | None:
        return self.torch.cuda.mem_get_info(self.device)[0] if self.cuda else None

    def unfreed(self) -> int | None:
        """Bytes the allocator keeps reserved beyond what is allocated once its free cache is
        returned: private pools (CUDA graphs') that ``empty_cache`` cannot release."""
        if not self.cuda:
            return None
        cuda = self.torch.cuda
        cuda.synchronize(self.device)
        cuda.empty_cache()
        return cuda.memory_reserved(self.device) - cuda.memory_allocated(self.device)
