"""diffserve/ports.py's free ports: below the kernel's ephemeral range, where no outgoing
connection can take one between its choice and the server's bind, never one that is taken, and
never one that another draw on this machine claimed a moment ago."""

from __future__ import annotations

import os
import random
import socket
import time

import pytest

from diffserve import ports as port_pool


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    low = port_pool._ephemeral_low()
    ports = [port_pool.free_port() for _ in range(20)]
    assert all(port_pool.FIRST_PORT <= port < low for port in ports), (ports, low)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))


@pytest.fixture
def draws(monkeypatch, tmp_path):
    """The ports free_port will draw, in order; its claims in a directory of this test's own."""
    monkeypatch.setattr(port_pool, "RESERVATIONS", tmp_path / "ports")
    ports: list[int] = []
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: ports.pop(0))
    return ports


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_port_that_is_taken_is_drawn_again(draws):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        other = unused_port()
        draws += [taken.getsockname()[1], other]
        assert port_pool.free_port() == other


def test_a_port_another_draw_claimed_is_not_drawn_until_the_claim_is_stale(draws):
    first, second = unused_port(), unused_port()
    draws += [first, first, second]
    assert port_pool.free_port() == first
    assert port_pool.free_port() == second  # first is claimed, though nothing listens on it yet
    old = time.time() - port_pool.RESERVED_S - 1
    os.utime(port_pool.RESERVATIONS / str(first), (old, old))
    draws.append(first)
    assert port_pool.free_port() == first
