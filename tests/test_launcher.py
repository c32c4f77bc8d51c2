"""diffserve/launcher.py's free ports: below the kernel's ephemeral range, where no outgoing
connection can take one between its choice and the server's bind, and never one that is taken."""

from __future__ import annotations

import random
import socket

from diffserve import launcher


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    low = launcher._ephemeral_low()
    ports = [launcher.free_port() for _ in range(20)]
    assert all(launcher.FIRST_PORT <= port < low for port in ports), (ports, low)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))


def test_a_port_that_is_taken_is_drawn_again(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", launcher.free_port()))
        taken.listen()
        draws = iter([taken.getsockname()[1], launcher.free_port()])
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(draws))
        assert launcher.free_port() != taken.getsockname()[1]
