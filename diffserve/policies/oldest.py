"""Oldest first: the set holding the request that arrived first goes.

Request mode serves one size's batch after another in arrival order; this is that order with
joins: a request of the running size joins at the next step, one of another size waits until
every request that arrived before it has finished. Nothing is shared between sizes, so no
request's steps are stretched by another size's (time-fair choice shares them, and both sizes
then take about twice as long); a request waits at most for what arrived before it, so nothing
starves.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

from diffserve.policies.base import Member, SetPolicy


class OldestFirst(SetPolicy):
    name = "oldest"

    def choose(self, sets: Mapping[Hashable, Sequence[Member]], now: float) -> Hashable:
        return min(sets, key=lambda key: min(m.arrived_at for m in sets[key]))
