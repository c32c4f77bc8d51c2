"""Which of several models are awake, applied: a task in the frontend's event loop that watches
each model's requests in flight, asks the swap policy (:mod:`diffserve.policies.swaps`) and
carries out its swaps as the engines' own sleep and wake (level 1: the weights to host memory
and back; level 2, past the host budget: dropped, and read again from the model's files at the
wake; never a rebuild), timing each. Also what /v1/models and /metrics say of each model."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from diffserve.errors import APIError
from diffserve.policies.swaps import Swap, SwapPolicy
from diffserve.wire.weight_commands import SLEEP, WAKE, WeightCommand

log = logging.getLogger("diffserve")

RETRY_S = 0.5  # a swap an engine refused (its executor restarting) is asked again after this
_SWAP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
DEVICE, HOST, DISK, FAILED = "device", "host", "disk", "failed"


@dataclass
class ModelRecord:
    """What /v1/models says of one model beside its info."""

    location: str = DEVICE
    size_bytes: int = 0
    loaded_at: float | None = None
    swapped_at: float | None = None
    last_swap_s: float | None = None
    error: str | None = None


class ModelMetrics:
    """Per model, in the frontend's registry: swaps, their time, resident bytes, queue depth."""

    def __init__(self, registry, names: list[str]) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.swaps_total = Counter(
            "diffserve_model_swaps", "Model swaps: in (woken for its requests) or out (put to "
            "sleep, in host memory or on disk, to make room).", ["model", "direction"], registry=registry)
        self.swap_seconds = Histogram(
            "diffserve_model_swap_seconds", "Time of a model's swap in (its wake) or out (its "
            "sleep, after its running work).", ["model", "direction"], buckets=_SWAP_BUCKETS,
            registry=registry)
        self.resident_bytes = Gauge(
            "diffserve_model_resident_bytes", "A model's weight bytes on its device (0 asleep).",
            ["model"], registry=registry)
        self.queue_depth = Gauge(
            "diffserve_model_queue_depth", "A model's requests accepted and not yet answered "
            "(queued or running).", ["model"], registry=registry)
        for name in names:
            for direction in ("in", "out"):
                self.swaps_total.labels(model=name, direction=direction)
                self.swap_seconds.labels(model=name, direction=direction)
            self.resident_bytes.labels(model=name)
            self.queue_depth.labels(model=name)

    def one_model(self, info, in_flight: int) -> None:
        """A one-model server's figures: its model resident on its device, never swapped."""
        self.resident_bytes.labels(model=info.name).set(weight_bytes(info))
        self.queue_depth.labels(model=info.name).set(in_flight)


def weight_bytes(info) -> int:
    """A model's weights, as its executor counted them (one rank's)."""
    return sum(c.bytes for c in info.components if c.rank == 0)


class Residency:
    def __init__(self, clients: dict, policy: SwapPolicy, records: dict[str, ModelRecord],
                 counts: ModelMetrics) -> None:
        """``clients``: each loaded model's engine client."""
        self.clients, self.policy, self.records, self.counts = clients, policy, records, counts
        self._changed = asyncio.Event()
        for name, client in list(clients.items()):
            self.add(name, client)

    def add(self, name: str, client) -> None:
        """A model that loaded (awake)."""
        self.clients[name] = client
        client.on_answered = self._changed.set

    async def swap(self, out: str | None, into: str | None) -> bool:
        """Put ``out`` to sleep or wake ``into`` now (at start, around a model's load)."""
        name, op = (out, SLEEP) if out is not None else (into, WAKE)
        swap = Swap((out,) if out else (), into, self.policy.to_disk([out]) if out else ())
        ok = await self._command(name, op, 2 if name in swap.disk else 1)
        if ok:
            self.policy.done(swap, time.monotonic(), swap.out, bool(into))
        return ok

    def arrived(self) -> None:
        """A request was sent to some model: look again."""
        self._changed.set()

    async def run(self) -> None:
        initial = self.policy.over_budget()  # at start: the models past the bounds sleep
        if initial is not None:
            self.policy.swapping = initial
            await self._apply(initial)
        while True:
            try:
                await self._decide()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop every later swap
                log.exception("the residency of the models failed to decide; deciding again")
                self.policy.swapping = None
                await asyncio.sleep(RETRY_S)

    async def _decide(self) -> None:
        """One decision: a swap carried out, or a wait for a change or a wait's bound."""
        self._changed.clear()
        now = time.monotonic()
        for name, client in self.clients.items():
            self.policy.observe(name, client.in_flight, now)
        swap = self.policy.next_swap(now)
        if swap is not None:
            await self._apply(swap)
            return
        try:
            await asyncio.wait_for(self._changed.wait(), self.policy.time_until_decision(now))
        except TimeoutError:
            pass

    async def _apply(self, swap: Swap) -> None:
        slept: list[str] = []
        for name in swap.out:
            if not await self._command(name, SLEEP, 2 if name in swap.disk else 1):
                break
            slept.append(name)
        woke = (swap.into is not None and len(slept) == len(swap.out)
                and await self._command(swap.into, WAKE))
        self.policy.done(swap, time.monotonic(), tuple(slept), woke)
        if len(slept) < len(swap.out) or (swap.into is not None and not woke):
            await asyncio.sleep(RETRY_S)  # an engine could not: its executor may be restarting

    async def _command(self, name: str, op: str, level: int = 1) -> bool:
        """One model's sleep (at ``level``) or wake, timed; whether it happened."""
        began = time.perf_counter()
        try:
            result = await self.clients[name].weights_command(WeightCommand("", op, level=level))
        except APIError as error:
            log.warning("model %r could not %s: %s", name, op, error.message)
            return False
        if result.status != 200:
            log.warning("model %r could not %s: %s", name, op, result.error)
            return False
        seconds = time.perf_counter() - began
        direction = "in" if op == WAKE else "out"
        record = self.records[name]
        record.location = DEVICE if op == WAKE else HOST if level == 1 else DISK
        record.swapped_at, record.last_swap_s = time.time(), seconds
        self.counts.swaps_total.labels(model=name, direction=direction).inc()
        self.counts.swap_seconds.labels(model=name, direction=direction).observe(seconds)
        log.info("model %r swapped %s%s in %.3f s", name, direction,
                 " (to disk)" if op == SLEEP and level == 2 else "", seconds)
        return True

    def update_gauges(self) -> None:
        for name, record in self.records.items():
            client = self.clients.get(name)
            self.counts.queue_depth.labels(model=name).set(client.in_flight if client else 0)
            self.counts.resident_bytes.labels(model=name).set(
                record.size_bytes if record.location == DEVICE else 0)
