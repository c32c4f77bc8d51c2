"""Free TCP ports for servers and process groups: drawn below the kernel's ephemeral range and
claimed machine-wide until their server has had time to bind them."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

FIRST_PORT = 10000


def free_port() -> int:
    """A TCP port nobody listens on right now, chosen below the kernel's ephemeral range. The
    kernel gives ports from that range to every outgoing connection (a client's, a gloo rank's),
    and one could take a port chosen there in the seconds before the server given it binds it
    (a server binds once its model has loaded). Drawn at random from the 22,000-odd ports
    between 10000 and that range; a port something holds (a Ray worker's, say) fails the bind and
    is drawn again, and so does one that another process on this machine drew in the last
    ``RESERVED_S`` (its server may not have bound it yet): see :func:`_reserve`."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(FIRST_PORT, low) if low > FIRST_PORT + 1024 else 0
        if port and not _reserve(port):
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # taken: another draw
                continue
            return sock.getsockname()[1]
    raise OSError("no free TCP port below the ephemeral range")


RESERVED_S = 600.0  # longer than any server takes to bind its port
RESERVATIONS = Path(tempfile.gettempdir()) / "diffserve-ports"


def _reserve(port: int) -> bool:
    """Claim ``port`` for this draw, machine-wide: a file named after it, created only if absent
    (or older than ``RESERVED_S``: a claim whose server has long bound the port, or never will).
    Two launches at once (a test run's workers, several servers' executors) then never draw the
    same port, where a bind check alone passes for both until either server binds."""
    path = RESERVATIONS / str(port)
    for _ in range(2):
        try:
            RESERVATIONS.mkdir(exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return True
        except FileExistsError:
            try:
                if time.time() - path.stat().st_mtime < RESERVED_S:
                    return False
                path.unlink()
            except FileNotFoundError:
                pass
        except OSError:  # no writable temporary directory: the bind check alone
            return True
    return False


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
