"""Which errors are the group's own: a peer gone or silent, a collective timed out. No retry of a
smaller batch can help with those; the group must go down and start again (its leader exits, the
scheduler answers what it held and starts it anew)."""

from __future__ import annotations


# What gloo's transport says when a peer is gone or silent. It raises them as plain
# RuntimeErrors, not DistErrors, and which one comes depends on when the peer died: a rank killed
# mid-collective gives "Connection reset by peer" on one run and "closed" on the next.
TRANSPORT_FAILURES = ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                      "Socket closed", "Read error", "Read timeout", "Timed out waiting")
# What NCCL says of a collective that timed out or a communicator a peer's failure aborted, where
# it reaches the caller as a plain RuntimeError (with asynchronous error handling on, the
# watchdog aborts the communicator and the waiting collective raises, instead of the process
# being killed: NCCL_ASYNC_ERROR_HANDLING below).
NCCL_FAILURES = ("NCCL communicator was aborted", "Watchdog caught collective operation timeout",
                 "ProcessGroupNCCL", "NCCL error", "ncclRemoteError", "ncclSystemError")
# The environment a group's ranks start NCCL with: a timed-out collective raises in the rank that
# waits on it (torch's TearDown mode), which then takes its group down like any of its failures.
NCCL_ASYNC_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def is_group_failure(error: BaseException) -> bool:
    """An error of the group itself (a peer gone, a collective timed out), which no retry of a
    smaller batch can help: the group must go down and start again."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(
        marker in text for marker in (*TRANSPORT_FAILURES, *NCCL_FAILURES))
