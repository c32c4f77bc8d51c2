"""Which errors are the group's own: a peer gone or silent, a collective timed out. No retry of a
smaller batch can help with those; the group must go down and start again (its leader exits, the
scheduler answers what it held and starts it anew)."""

from __future__ import annotations


# What gloo's transport says when a peer is gone or silent. It raises them as plain
# RuntimeErrors, not DistErrors, and which one comes depends on when the peer died: a rank killed
# mid-collective gives "Connection reset by peer" on one run and "closed" on the next.
TRANSPORT_FAILURES = ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                      "Socket closed", "Read error", "Read timeout", "Timed out waiting")


def is_group_failure(error: BaseException) -> bool:
    """An error of the group itself (a peer gone, a collective timed out), which no retry of a
    smaller batch can help: the group must go down and start again."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(marker in text for marker in TRANSPORT_FAILURES)
