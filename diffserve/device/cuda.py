"""CUDA: work is queued on streams, timed with events, memory counted by torch's allocator. The
one module of diffserve that writes ``torch.cuda``."""

from __future__ import annotations

import torch

from diffserve.device.base import GLOO_FAILURES, Device

# What NCCL says of a collective that timed out or a communicator a peer's failure aborted, where
# it reaches the caller as a plain RuntimeError.
NCCL_FAILURES = ("NCCL communicator was aborted", "Watchdog caught collective operation timeout",
                 "ProcessGroupNCCL", "NCCL error", "ncclRemoteError", "ncclSystemError")
# NCCL's watchdog on a timed-out collective or a failed peer. torch's modes (ProcessGroupNCCL's
# ErrorHandlingMode): 1 TearDown and 3 SkipCleanUp end the process from the watchdog's thread
# (nothing to match, the scheduler learns of it from a dead process); 2 CleanUpOnly aborts the
# communicators, so the waiting collective raises in the rank, which takes its group down like
# any of its failures (``diffserve.executor.parallel.failures``).
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def _dev(device):
    return torch.device(device) if device is not None else None


class CudaDevice(Device):
    kind = "cuda"
    queued = True
    pinned = True
    # gloo beside NCCL for host tensors: diffusers' Ulysses attention all-gathers each rank's
    # sequence length before its all-to-alls, on the host where the group has gloo (no device
    # round trip and synchronisation per attention).
    dist_backend = "cpu:gloo,cuda:nccl"
    dist_env = NCCL_ERROR_HANDLING
    collective_failures = (*GLOO_FAILURES, *NCCL_FAILURES)

    def available(self) -> bool:
        return torch.cuda.is_available()

    def count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def set_current(self, device) -> None:
        torch.cuda.set_device(_dev(device))

    def synchronize(self, device=None) -> None:
        torch.cuda.synchronize(_dev(device))

    def stream(self, device):
        return torch.cuda.Stream(_dev(device))

    def current_stream(self, device=None):
        return torch.cuda.current_stream(_dev(device))

    def on_stream(self, stream):
        return torch.cuda.stream(stream)

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing)

    def allocated(self, device) -> int:
        return torch.cuda.memory_allocated(_dev(device))

    def peak_allocated(self, device) -> int:
        return torch.cuda.max_memory_allocated(_dev(device))

    def reset_peak(self, device) -> None:
        torch.cuda.reset_peak_memory_stats(_dev(device))

    def reserved(self, device) -> int:
        return torch.cuda.memory_reserved(_dev(device))

    def free_total(self, device) -> tuple[int, int]:
        return torch.cuda.mem_get_info(_dev(device))

    def total(self, device) -> int:
        return torch.cuda.get_device_properties(_dev(device)).total_memory

    def memory_fraction(self, device) -> float:
        return torch.cuda.get_per_process_memory_fraction(_dev(device))

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def empty_host_cache(self) -> None:
        torch.accelerator.empty_host_cache()

    def bf16_native(self, device) -> bool:
        """Of the current device (torch asks no other), which the executor made its own before
        loading. ``is_bf16_supported()`` alone is True on a T4 or V100, which only emulate it."""
        return torch.cuda.is_bf16_supported(including_emulation=False)

    def name(self, device) -> str:
        return torch.cuda.get_device_name(_dev(device))

    def capability(self, device) -> tuple[int, int]:
        return tuple(torch.cuda.get_device_capability(_dev(device)))

    def describe(self, device) -> dict:
        return {"name": self.name(device), "capability": list(self.capability(device))}
