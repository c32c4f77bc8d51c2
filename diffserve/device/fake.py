"""A CUDA-like device that runs on the CPU, for tests: it says it is ``cuda``, with the count,
name, capability, memory and bfloat16 support a test sets, so that the decisions taken only on a
GPU (the float32 reference's place, auto dtype on a card that emulates bfloat16, the memory
budget, sleep's pinned buffers) run without one. Install it with :func:`diffserve.device.installed`.

Tensors stay on the CPU: the fake answers questions, it does not move work. Every per-device
question is logged in ``asked`` as (question, device); its events read the clock.
"""

from __future__ import annotations

import time
import weakref
from contextlib import nullcontext

from diffserve.device.cuda import CudaDevice

GiB = 1 << 30


class FakeEvent:
    def __init__(self, clock) -> None:
        self.clock, self.at = clock, None

    def record(self, stream=None) -> None:
        self.at = self.clock()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, as CUDA's


class FakeStream:
    def wait_event(self, event) -> None:
        pass


class FakeCuda(CudaDevice):
    """A GPU's answers (an 80 GiB card by default), set by the test."""

    def __init__(self, count: int = 1, name: str = "Fake GPU", capability=(9, 0),
                 total: int = 80 * GiB, free: int | None = None, reserved: int = 0,
                 allocated: int = 0, fraction: float = 1.0, bf16_native: bool = True,
                 clock=time.perf_counter) -> None:
        self.gpus, self.card, self.cap = count, name, tuple(capability)
        self.total_bytes, self.free_bytes = total, total if free is None else free
        self.reserved_bytes, self.allocated_bytes, self.peak_bytes = reserved, allocated, allocated
        self.fraction, self.bf16, self.clock = fraction, bf16_native, clock
        self.asked: list[tuple[str, object]] = []
        self.current = None  # the device set_current chose
        self.emptied = 0  # empty_cache calls
        self.pinned_live = 0  # bytes of pinned host blocks held by tensors (rounded as torch does)
        self.pinned_cached = 0  # bytes of freed pinned blocks the host allocator still keeps
        self.pinned_sizes: list[int] = []  # each pinned allocation's rounded size

    def _ask(self, question: str, device=None) -> None:
        import torch

        self.asked.append((question, torch.device(device) if device is not None else None))

    def available(self) -> bool:
        return self.gpus > 0

    def count(self) -> int:
        return self.gpus

    def set_current(self, device) -> None:
        self._ask("set_current", device)
        self.current = device

    def synchronize(self, device=None) -> None:
        self._ask("synchronize", device)

    def stream(self, device):
        return FakeStream()

    def current_stream(self, device=None):
        return FakeStream()

    def on_stream(self, stream):
        return nullcontext()

    def event(self, timing: bool = False):
        return FakeEvent(self.clock)

    def allocated(self, device) -> int:
        self._ask("allocated", device)
        return self.allocated_bytes

    def peak_allocated(self, device) -> int:
        self._ask("peak_allocated", device)
        return self.peak_bytes

    def reset_peak(self, device) -> None:
        self._ask("reset_peak", device)
        self.peak_bytes = self.allocated_bytes

    def reserved(self, device) -> int:
        self._ask("reserved", device)
        return self.reserved_bytes

    def free_total(self, device) -> tuple[int, int]:
        self._ask("free_total", device)
        return self.free_bytes, self.total_bytes

    def total(self, device) -> int:
        self._ask("total", device)
        return self.total_bytes

    def memory_fraction(self, device) -> float:
        self._ask("memory_fraction", device)
        return self.fraction

    def empty_cache(self) -> None:
        self.emptied += 1

    def host_buffer(self, numel: int, dtype):
        """A plain host tensor, counted as torch's pinned allocator would hold it: rounded up
        to a power of two, kept in its cache once freed until :meth:`empty_host_cache`."""
        import torch

        buffer = torch.empty(numel, dtype=dtype)
        size = 1 << max(0, (numel * buffer.element_size() - 1).bit_length())
        self.pinned_sizes.append(size)
        self.pinned_live += size
        weakref.finalize(buffer, self._unpinned, size)
        return buffer

    def _unpinned(self, size: int) -> None:
        self.pinned_live -= size
        self.pinned_cached += size

    def empty_host_cache(self) -> None:
        self.pinned_cached = 0

    def bf16_native(self, device) -> bool:
        return self.bf16

    def name(self, device) -> str:
        self._ask("name", device)
        return self.card

    def capability(self, device) -> tuple[int, int]:
        self._ask("capability", device)
        return self.cap
