"""What diffserve asks of a kind of device. The defaults are the answers of a device whose work
is done when its call returns and whose memory is the host's (the CPU's): no streams or events,
no memory counted, nothing to synchronise. A kind with queued work (CUDA) overrides them.

Every per-device question names its device: on a host with several GPUs a call that names none
would read the current one.
"""

from __future__ import annotations

from contextlib import nullcontext

# What gloo's transport says when a peer is gone or silent. It raises them as plain
# RuntimeErrors, not DistErrors, and which one comes depends on when the peer died: a rank killed
# mid-collective gives "Connection reset by peer" on one run and "closed" on the next.
GLOO_FAILURES = ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                 "Socket closed", "Read error", "Read timeout", "Timed out waiting")


class Device:
    kind = "cpu"  # torch's device type
    queued = False  # work is queued and runs later: time it with events, wait to read it
    pinned = False  # host copies can be page-locked (copies to and from it run asynchronously)
    dist_backend = "gloo"  # a parallel group's torch.distributed backend
    dist_env: dict[str, str] = {}  # environment a group's ranks start it with (operator's wins)
    collective_failures: tuple[str, ...] = GLOO_FAILURES  # a group's own errors, by their text

    # Choice.
    def available(self) -> bool:
        return False

    def count(self) -> int:
        """Accelerators of this kind visible to the process (0 for the CPU)."""
        return 0

    def set_current(self, device) -> None:
        """Make ``device`` the one a call without a device uses (a library's workspace, an event)."""

    # Synchronisation, streams and events.
    def synchronize(self, device=None) -> None:
        """Wait until ``device`` (None: the current one) has done what was queued on it."""

    def stream(self, device):
        """A new stream on ``device``, or None where work is not queued."""
        return None

    def current_stream(self, device=None):
        return None

    def on_stream(self, stream):
        """A context in which work is queued on ``stream`` (None: where it would be anyway)."""
        return nullcontext()

    def event(self, timing: bool = False):
        raise RuntimeError(f"{self.kind}: no events (work is done when its call returns)")

    # Memory: None where the kind does not count it.
    def allocated(self, device) -> int | None:
        return None

    def peak_allocated(self, device) -> int | None:
        return None

    def reset_peak(self, device) -> None:
        pass

    def reserved(self, device) -> int | None:
        return None

    def free_total(self, device) -> tuple[int, int] | None:
        """(free, total) bytes of ``device``."""
        return None

    def total(self, device) -> int | None:
        return None

    def memory_fraction(self, device) -> float:
        """The share of ``device``'s memory this process may allocate."""
        return 1.0

    def empty_cache(self) -> None:
        """The allocator's cached blocks back to the device."""

    def host_buffer(self, numel: int, dtype):
        """``numel`` elements of host memory, pinned where this kind pins."""
        import torch

        return torch.empty(numel, dtype=dtype, pin_memory=self.pinned)

    def empty_host_cache(self) -> None:
        """Pinned host blocks no tensor holds back to the host."""

    # What the card is.
    def bf16_native(self, device) -> bool:
        """Whether ``device`` computes in bfloat16 natively (emulation does not count)."""
        return False

    def name(self, device) -> str:
        return self.kind

    def capability(self, device) -> tuple[int, int] | None:
        return None

    def describe(self, device) -> dict:
        """The card, for a verdict's key ({} where there is no card)."""
        return {}
