"""Who the step engine holds, and every change of that between two steps: a work item admitted
(or waiting inside the engine for adapter slots), paused and parked off the device, resumed,
cancelled, failed, retired, or all of it abandoned. The step's forward is
:mod:`~diffserve.executor.step.engine`; this is its bookkeeping, torch-free but for parking.

LoRA adapters never split a running set: each request holds its own stack of adapter versions
from admission to retirement (:meth:`Members.acquire`, :meth:`Members.release`). A request whose
adapters cannot all be resident yet (every slot is held by running requests) waits inside the
engine and joins at a later step.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

from diffserve.executor.memory.parking import park, unpark
from diffserve.executor.results import Outcome
from diffserve.executor.step.planner import Planned, StepPlan
from diffserve.executor.step.units import StepOutput, Unit, Waiting
from diffserve.wire.request import WorkItem


def request_id(unit: Unit) -> str:
    return unit.request.request_id


class Members:
    """The running units, the items waiting for adapter slots and the paused units of one step
    engine. ``on_leave(batch_key)`` is told whenever a unit leaves its running set (the set's
    stacked inputs are stale then)."""

    def __init__(self, family, adapters, clock: Callable[[], float],
                 on_leave: Callable[[tuple], None]) -> None:
        self.family, self.adapters, self.clock, self.on_leave = family, adapters, clock, on_leave
        self.units: list[Unit] = []
        self.waiting: list[Waiting] = []  # for adapter slots
        self.paused: dict[tuple[str, int], Unit] = {}  # out of the running sets, state kept
        self.cancelled: set[str] = set()  # callers gone: they leave at the next step
        self.pausing: set[tuple[str, int]] = set()  # to be paused at the next step

    def held(self) -> list[Unit]:
        return [*self.units, *self.paused.values()]

    # -- adapters --------------------------------------------------------------------------

    def acquire(self, item: WorkItem):
        """The item's adapter stack (held from now on), () without adapters, None to wait."""
        loras = item.request.loras
        if not loras:
            return ()
        if self.adapters is None:
            raise ValueError("this server serves no LoRA adapters")
        return self.adapters.acquire(loras)

    def release(self, stack) -> None:
        if stack:
            self.adapters.release(stack)

    def rows(self, stacks: list):
        """A context in which row i of every adapted call gets ``stacks[i]``."""
        if self.adapters is None or not any(stacks):
            return nullcontext()
        return self.adapters.rows.rows(stacks)

    def adapters_fit(self, item: WorkItem) -> bool:
        return self.adapters is None or self.adapters.fits(item.request.loras)

    # -- what the scheduler asks -------------------------------------------------------------

    def cancel(self, request_ids: list[str]) -> None:
        """These requests leave at the next step."""
        held = {request_id(u) for u in self.held()} | {w.item.request.request_id
                                                        for w in self.waiting}
        self.cancelled.update(rid for rid in request_ids if rid in held)

    def pause(self, keys: list[tuple[str, int]]) -> None:
        """These running items leave their running sets at the next step; their latents,
        schedulers and generators stay with them (off the accelerator) until they resume."""
        running = {u.key for u in self.units}
        self.pausing.update(key for key in keys if key in running)

    def resume(self, item: WorkItem) -> None:
        """A paused item back into its running set, where it continues from the step it left
        (an item that finished before its pause came is not here: the resume is dropped)."""
        if item.key in self.pausing:  # resumed before the pause took effect: it never stops
            self.pausing.discard(item.key)
            return
        unit = self.paused.pop(item.key, None)
        if unit is not None:
            if self._off_host:
                unpark(unit, self.family.device)
            self.units.append(unit)

    # -- a step's changes ------------------------------------------------------------------

    def entries(self) -> tuple[list[Planned], list[Planned]]:
        """The running and the waiting requests as the planner sees them."""
        running = [Planned(request_id(u), u.batch_key, u.member, start=u.item.start)
                   for u in self.units]
        waiting = [Planned(w.item.request.request_id, w.batch_key, w.member,
                           self.adapters_fit(w.item)) for w in self.waiting]
        return running, waiting

    def leave(self, plan: StepPlan, out: StepOutput) -> None:
        """The planned leaves (cancelled requests, paused ones among them) answered cancelled."""
        gone = set(plan.leave) | {key[0] for key in self.paused if key[0] in self.cancelled}
        self.cancelled = set()
        if not gone:
            return
        for key in [key for key in self.paused if key[0] in gone]:
            self.units.append(self.paused.pop(key))  # to leave as the running ones do
        for u in [u for u in self.units if request_id(u) in gone]:
            self.remove(u, out, Outcome.cancelled(u.item, self.clock() - u.admitted_at))
        for w in [w for w in self.waiting if w.item.request.request_id in gone]:
            self.waiting.remove(w)
            out.finished.append(Outcome.cancelled(w.item, 0.0))

    def park(self, plan: StepPlan) -> None:
        """The planned pauses: out of their running sets, their state off the accelerator (its
        memory goes to the others; nothing moves on a CPU)."""
        self.pausing = set()
        if not plan.pause:  # every step: nothing to do unless a pause is due
            return
        pausing = set(plan.pause)
        for unit in [u for u in self.units if u.key in pausing]:
            self.units.remove(unit)
            if self._off_host:
                park(unit)
            self.paused[unit.key] = unit
            self.on_leave(unit.batch_key)

    def joining(self, plan: StepPlan) -> list[Waiting]:
        """The waiting items the plan admits now, out of the waiting list."""
        joining = set(plan.join)
        now = [w for w in self.waiting if w.item.request.request_id in joining]
        self.waiting = [w for w in self.waiting if w.item.request.request_id not in joining]
        return now

    def remove(self, unit: Unit, out: StepOutput, outcome: Outcome) -> None:
        """A running unit out, answered with ``outcome``."""
        if unit in self.units:
            self.drop(unit)
            out.finished.append(outcome)

    def drop(self, unit: Unit) -> None:
        """Out of the running set, its adapters released, its step cache gone."""
        self.units.remove(unit)
        self.release(unit.adapters)
        unit.cache = None
        self.on_leave(unit.batch_key)

    def abandon(self, error: str) -> list[Outcome]:
        """Everything held failed with ``error``, its adapters released; empty afterwards."""
        now = self.clock()
        held = self.held()
        outcomes = [Outcome.failed(u.item, error, now - u.admitted_at) for u in held]
        outcomes += [Outcome.failed(w.item, error, 0.0) for w in self.waiting]
        for unit in held:
            self.release(unit.adapters)
        self.units, self.waiting, self.paused, self.cancelled = [], [], {}, set()
        return outcomes

    @property
    def _off_host(self) -> bool:
        return self.family.torch.device(self.family.device).type != "cpu"
