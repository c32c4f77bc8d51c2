"""Time-fair set choice: every running request loses about the same time to the others.

1. A set that has not taken a step yet goes first: a request of a new size starts at the next
   step, whatever else runs.
2. Otherwise, the set holding the request that has lost the most time goes: a request's lost
   time is its age (since it arrived at the scheduler, its wait in the queue included) minus the
   time of the steps it took part in.

A lone request of a rare size is not starved by a busy common size (its lost time grows with
every step of the busy set until it is the largest), and a busy size is not halted by one odd
request (once that request has had its turn, the busy set's members are the ones that lost the
most). Counting the queue wait makes a set's share follow its waiting work: where one size's
requests wait longer for room (its set is the bottleneck, say its images cost more, so fewer fit
in a forward), they arrive older and their set gets more of the steps, and the queue does not
pile up behind it. Where steps of one size cost more than of another, both lose the same *time*,
not the same number of steps.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

from diffserve.policies.base import Member, SetPolicy


class TimeFair(SetPolicy):
    name = "fair"

    def choose(self, sets: Mapping[Hashable, Sequence[Member]], now: float) -> Hashable:
        fresh = [key for key, members in sets.items() if not any(m.steps for m in members)]
        if fresh:
            return min(fresh, key=lambda key: min(m.arrived_at for m in sets[key]))
        return max(sets, key=lambda key: max(m.lost(now) for m in sets[key]))
