"""Which models stay awake when a server holds more than fit (``--resident-models``, a byte
budget), and when one is swapped for another: a pure object, driven with the time and each
model's count of requests in flight (accepted, not yet answered: queued or running).

Rules, in order:

- a model with requests and asleep is woken at once where there is room;
- else an idle resident model (nothing in flight for ``idle_grace_s``, a tenth of the bound by
  default: the rest of a burst finds it awake) makes room, the least recently used first; a
  resident model with work is never put to sleep while an idle one could be;
- else the sleeping model waits while the resident ones serve their queues, but no longer than
  ``max_wait_s`` from when its first waiting request was seen; then a model idle within its
  grace makes room, else the model resident longest (its running work finishes first; its queue
  waits for its turn back);
- one swap at a time: the caller reports its end (:meth:`SwapPolicy.done`).

The oldest waiting model is served first, so no model starves another.

Past a host budget (``host_budget_bytes``: the most weight bytes the sleeping models keep in host
memory), a model put to sleep goes to disk instead (level 2: its weights dropped, read again from
its files at its wake) where it does not fit beside those already asleep in host memory. A model
asleep in host memory stays there: moving it to disk would take a wake of its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelState:
    name: str
    size: int = 0  # its weights' bytes, as the executor counted them
    resident: bool = False  # awake on its device (False: asleep in host memory, or not loaded)
    failed: str = ""  # why it could not load: it takes no part
    in_flight: int = 0
    waiting_since: float | None = None  # asleep with requests: since when
    last_used: float = 0.0  # when it last had requests in flight
    resident_since: float = 0.0
    on_disk: bool = False  # asleep with its weights dropped (level 2)


@dataclass(frozen=True)
class Swap:
    """Put ``out`` to sleep, in order, then wake ``into`` (``into`` None: only sleep them);
    those of ``out`` also in ``disk`` sleep on disk (level 2), the others in host memory."""

    out: tuple[str, ...]
    into: str | None
    disk: tuple[str, ...] = ()


class SwapPolicy:
    def __init__(self, names: list[str], limit: int = 0, budget_bytes: int = 0,
                 max_wait_s: float = 5.0, idle_grace_s: float | None = None,
                 host_budget_bytes: int = 0, host_copies: int = 1) -> None:
        """``limit``: most models awake (0: no limit); ``budget_bytes``: most weight bytes awake
        (0: none); ``idle_grace_s``: how long a model must have been idle to give way before the
        bound (default: a tenth of ``max_wait_s``); ``host_budget_bytes``: most weight bytes
        asleep in host memory (0: none; past it, on disk), where each model sleeps as
        ``host_copies`` copies (one per executor's rank: each keeps its own)."""
        self.models = {name: ModelState(name) for name in names}
        self.limit, self.budget_bytes, self.max_wait_s = limit, budget_bytes, max_wait_s
        self.host_budget_bytes, self.host_copies = host_budget_bytes, host_copies
        self.idle_grace_s = max_wait_s / 10 if idle_grace_s is None else idle_grace_s
        self.swapping: Swap | None = None

    # -- what the caller reports -----------------------------------------------------------

    def loaded(self, name: str, size: int, now: float) -> None:
        state = self.models[name]
        state.size, state.resident, state.resident_since = size, True, now

    def failed(self, name: str, reason: str) -> None:
        state = self.models[name]
        state.failed, state.resident = reason, False

    def observe(self, name: str, in_flight: int, now: float) -> None:
        """A model's requests in flight now."""
        state = self.models[name]
        if in_flight or state.in_flight:  # busy, or busy until now
            state.last_used = now
        state.in_flight = in_flight
        if in_flight and not state.resident and state.waiting_since is None:
            state.waiting_since = now
        elif not in_flight or state.resident:
            state.waiting_since = None

    def done(self, swap: Swap, now: float, slept: tuple[str, ...], woke: bool) -> None:
        """A swap ended: the models of ``slept`` sleep, and ``into`` is awake where ``woke``."""
        for name in slept:
            state = self.models[name]
            state.resident, state.on_disk = False, name in swap.disk
            if state.in_flight:  # its queue waits from now
                state.waiting_since = now
        if swap.into is not None and woke:
            state = self.models[swap.into]
            state.resident, state.resident_since, state.waiting_since = True, now, None
            state.on_disk = False
        self.swapping = None

    # -- decisions -------------------------------------------------------------------------

    def over_budget(self) -> Swap | None:
        """The models to put to sleep so that the awake ones fit (at start, the last ones)."""
        awake = self._awake()
        out = []
        while awake and not self._fits(awake):
            out.append(awake.pop().name)
        return Swap(tuple(out), None, self.to_disk(out)) if out else None

    def next_swap(self, now: float) -> Swap | None:
        if self.swapping is not None:
            return None
        wanted = self._wanted()
        if wanted is None:
            return None
        awake = self._awake()
        idle = sorted((m for m in awake if self._idle(m, now)), key=lambda m: m.last_used)
        resting = sorted((m for m in awake if not m.in_flight and m not in idle),
                         key=lambda m: m.last_used)  # idle within its grace
        busy = sorted((m for m in awake if m.in_flight), key=lambda m: m.resident_since)
        past_bound = now - wanted.waiting_since >= self.max_wait_s
        order = idle + (resting + busy if past_bound else [])
        out: list[ModelState] = []
        while not self._fits([m for m in awake if m not in out] + [wanted]):
            if len(out) == len(order):
                return None  # it waits for a resident model to go idle, or for its bound
            out.append(order[len(out)])
        names = [m.name for m in out]
        self.swapping = Swap(tuple(names), wanted.name, self.to_disk(names, wanted.name))
        return self.swapping

    def to_disk(self, out: list[str], into: str | None = None) -> tuple[str, ...]:
        """Which of ``out``, put to sleep in this order, go to disk: each that would take the
        bytes asleep in host memory past the host budget (``into``, woken by the same swap, no
        longer counts: its host copy goes as it wakes)."""
        if not self.host_budget_bytes:
            return ()
        held = sum(m.size for m in self.models.values()
                   if not m.resident and not m.failed and not m.on_disk and m.name != into)
        held *= self.host_copies
        disk = []
        for name in out:
            size = self.models[name].size * self.host_copies
            if held + size <= self.host_budget_bytes:
                held += size
            else:
                disk.append(name)
        return tuple(disk)

    def time_until_decision(self, now: float) -> float | None:
        """Seconds until a waiting model's bound, or an idle model's grace, passes (a decision
        that no report triggers)."""
        wanted = self._wanted()
        if wanted is None or self.swapping is not None:
            return None
        graces = [m.last_used + self.idle_grace_s for m in self._awake() if not m.in_flight]
        return max(0.0, min([wanted.waiting_since + self.max_wait_s, *graces]) - now)

    # -- helpers ---------------------------------------------------------------------------

    def _wanted(self) -> ModelState | None:
        """The asleep model whose requests have waited longest."""
        asleep = [m for m in self.models.values() if not m.resident and not m.failed
                  and m.in_flight and m.waiting_since is not None]
        return min(asleep, key=lambda m: m.waiting_since, default=None)

    def _idle(self, model: ModelState, now: float) -> bool:
        return not model.in_flight and now - model.last_used >= self.idle_grace_s

    def _awake(self) -> list[ModelState]:
        return [m for m in self.models.values() if m.resident and not m.failed]

    def _fits(self, models: list[ModelState]) -> bool:
        return ((not self.limit or len(models) <= self.limit)
                and (not self.budget_bytes or sum(m.size for m in models) <= self.budget_bytes))
