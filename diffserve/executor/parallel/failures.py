"""Which errors are the group's own: a peer gone or silent, a collective timed out. No retry of a
smaller batch can help with those; the group must go down and start again (its leader exits, the
scheduler answers what it held and starts it anew).

What each backend says of such a failure is the device layer's (``collective_failures`` of each
kind: gloo's transport on every kind, NCCL's aborted communicators and timed-out collectives on
CUDA, where ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` makes the waiting collective raise instead of the
watchdog ending the process)."""

from __future__ import annotations


def failure_markers() -> tuple[str, ...]:
    """Every kind's markers: an error is matched by its text whichever kind raised it."""
    from diffserve.device.cpu import CpuDevice
    from diffserve.device.cuda import CudaDevice

    return tuple(dict.fromkeys((*CpuDevice.collective_failures, *CudaDevice.collective_failures)))


def is_group_failure(error: BaseException) -> bool:
    """An error of the group itself (a peer gone, a collective timed out), which no retry of a
    smaller batch can help: the group must go down and start again."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(marker in text for marker in failure_markers())
