"""Where a half-precision model's float32 reference runs: the device's room (its free memory,
less a configured cap and the process's memory fraction) against what the upcast adds, asked once
per start and, in a parallel group, the leader's answer on every rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diffserve.device import installed
from diffserve.device.fake import FakeCuda
from diffserve.executor.checks import float32

GiB = 1 << 30


@pytest.fixture
def card():
    """An 80 GB card (the device layer's fake GPU); the test sets what is free."""
    with installed(FakeCuda(total=80 * GiB, free=60 * GiB, reserved=10 * GiB)) as fake:
        yield fake


def test_room_is_the_least_of_free_memory_the_cap_and_the_fraction(card):
    assert float32.room("cuda:0") == 60 * GiB
    assert float32.room("cuda:0", cap=40 * GiB) == 30 * GiB  # the cap counts what is held
    card.fraction = 0.5  # an 80 GB card emulated on a larger one, or a shared node's share
    assert float32.room("cuda:0") == 30 * GiB
    card.fraction, card.free_bytes = 1.0, 5 * GiB
    assert float32.room("cuda:0", cap=70 * GiB) == 5 * GiB
    card.reserved_bytes = 75 * GiB  # held past the cap: no room, never negative
    assert float32.room("cuda:0", cap=70 * GiB) == 0
    assert float32.room("cpu") is None
    assert {device for _, device in card.asked} == {torch.device("cuda:0")}  # never the current


def _runtime(device="cuda:0", group=None):
    linear = torch.nn.Linear(1024, 1024).to(torch.bfloat16)
    pipe = SimpleNamespace(components={"transformer": linear})
    return SimpleNamespace(loaded=SimpleNamespace(pipe=pipe, device=device), group=group)


def test_the_reference_runs_on_the_host_where_the_upcast_does_not_fit(card):
    rt = _runtime()
    extra = float32.extra_bytes(rt.loaded.pipe)
    assert extra == (1024 * 1024 + 1024) * 2  # bfloat16 to float32: two bytes a value more
    card.free_bytes = extra * 2
    assert float32.place(rt) == float32.DEVICE
    card.free_bytes = extra  # the upcast alone would take it all: nothing left for activations
    assert float32.place(rt) == float32.HOST
    card.free_bytes = extra * 2
    assert float32.place(rt, cap=card.reserved_bytes + extra) == float32.HOST
    assert float32.place(_runtime("cpu")) == float32.DEVICE  # the host's own memory


class Leader:
    """A group whose leader answered ``answer``: every rank takes it, whatever its own."""

    def __init__(self, answer: str) -> None:
        self.answer, self.asked = answer, []

    def broadcast(self, value):
        self.asked.append(value)
        return self.answer


def test_every_rank_takes_the_leaders_answer(card):
    group = Leader(float32.HOST)
    assert float32.place(_runtime(group=group)) == float32.HOST
    assert group.asked == [float32.DEVICE]  # this rank alone would have said device


def test_a_reference_the_host_cannot_hold_is_skipped(card, monkeypatch, caplog):
    """Qwen-Image under an 80 GB cap: ~115 GB of float32 weights would go to a 128 GiB host."""
    rt = _runtime()
    card.free_bytes = float32.extra_bytes(rt.loaded.pipe)  # no room on the card: the host's turn
    # host_bytes counts the tensors off the host; the fake card's weights are on the CPU.
    monkeypatch.setattr(float32, "host_bytes", lambda pipe: 115 * 10**9)
    monkeypatch.setattr(float32, "host_available", lambda: 120 * GiB)
    assert float32.place(rt) == float32.SKIP
    assert "115.0 GB on the host" in caplog.text and "skipped" in caplog.text
    monkeypatch.setattr(float32, "host_available", lambda: 200 * GiB)
    assert float32.place(rt) == float32.HOST
    monkeypatch.setattr(float32, "host_available", lambda: None)  # unknown: not refused
    assert float32.place(rt) == float32.HOST
    assert float32.run(rt, [object()], lambda rt, r: 1 / 0, float32.SKIP) is None


def test_host_shortfall_keeps_a_margin():
    assert float32.host_shortfall(80, 100) is None
    assert float32.host_shortfall(81, 100) is not None  # past HOST_SHARE of what is available
    assert float32.host_shortfall(10**12, None) is None


def test_a_model_served_on_the_host_counts_its_upcast_against_the_host(monkeypatch):
    rt = _runtime("cpu")
    extra = float32.extra_bytes(rt.loaded.pipe)
    monkeypatch.setattr(float32, "host_available", lambda: extra)
    assert float32.place(rt) == float32.SKIP
    monkeypatch.setattr(float32, "host_available", lambda: extra * 2)
    assert float32.place(rt) == float32.DEVICE


def test_host_bytes_counts_the_weights_off_the_host_in_float32():
    linear = torch.nn.Linear(8, 8).to(torch.bfloat16)
    pipe = SimpleNamespace(components={"transformer": linear})
    assert float32.host_bytes(pipe) == 0  # already on the host: the upcast is extra_bytes'
    meta = torch.nn.Linear(8, 8, device="meta").to(torch.bfloat16)
    assert float32.host_bytes(SimpleNamespace(components={"t": meta})) == (64 + 8) * 4
