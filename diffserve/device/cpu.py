"""The CPU: work is done when its call returns, its memory is the host's (not counted here)."""

from __future__ import annotations

from diffserve.device.base import Device


class CpuDevice(Device):
    kind = "cpu"

    def available(self) -> bool:
        return True
