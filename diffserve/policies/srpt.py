"""Soonest completion first, with a bound on what any request loses.

Time-fair choice is processor sharing: two sets of equal work each take twice as long. This rule
instead advances the set whose nearest completion comes soonest (its member with the least
remaining work: remaining steps x the set's seconds per step), so requests near their end leave
first and the mean latency falls, as shortest-remaining-time-first does on one processor.

Alone, that could starve a rare size behind a busy one whose newcomers keep joining. The bound:
a request that has lost more time than ``patience`` x its own processing time (its steps x its
set's seconds per step; for a set that has not stepped yet, the running sets' mean) makes its set
go first, the most overdue first. So a request loses at most about that much, plus a step of
another set: with the default patience 1, its latency stays near twice what it takes alone
(more where a size is cheaper per step than the busy one it waits behind, whose pace it is
judged by until it starts).
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

from diffserve.policies.base import Member, SetPolicy


class SoonestFirst(SetPolicy):
    name = "srpt"

    def __init__(self, patience: float = 1.0) -> None:
        if patience <= 0:
            raise ValueError(f"patience must be > 0, got {patience}")
        self.patience = patience

    def choose(self, sets: Mapping[Hashable, Sequence[Member]], now: float) -> Hashable:
        pace = _paces(sets)
        overdue = {key: max(m.lost(now) for m in members) for key, members in sets.items()
                   if any(m.lost(now) > self.patience * m.total_steps * pace[key]
                          for m in members)}
        if overdue:
            return max(overdue, key=overdue.get)
        return min(sets, key=lambda key: (min(m.remaining for m in sets[key]) * pace[key],
                                          min(m.arrived_at for m in sets[key])))


def _paces(sets: Mapping[Hashable, Sequence[Member]]) -> dict[Hashable, float]:
    """Seconds per step of each set, from the steps its members took; a set that has not
    stepped yet is taken at the mean pace of the others (1 where none has stepped)."""
    measured = {key: sum(m.stepped_s for m in members) / sum(m.steps for m in members)
                for key, members in sets.items() if any(m.steps for m in members)}
    mean = sum(measured.values()) / len(measured) if measured else 1.0
    return {key: measured.get(key, mean) for key in sets}
