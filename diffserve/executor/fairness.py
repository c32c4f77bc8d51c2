"""Which running set the next denoising step advances, when an executor holds several (one per
size, or whatever else must match within one forward).

The rule, fair in time per request:

1. A set that has not taken a step yet goes first: a request of a new size starts at the next
   step, whatever else runs.
2. Otherwise, the set holding the request that has lost the most time goes: a request's lost
   time is its age (since it arrived at the scheduler, its wait in the queue included) minus the
   time of the steps it took part in.

So every request loses about the same time to everything else. A lone request of a rare size is
not starved by a busy common size (its lost time grows with every step of the busy set until it is
the largest), and a busy size is not halted by one odd request (once that request has had its
turn, the busy set's members are the ones that lost the most). Counting the queue wait makes a
set's share follow its waiting work: where one size's requests wait longer for room (its set is
the bottleneck, say its images cost more, so fewer fit in a forward), they arrive older and their
set gets more of the steps, and the queue does not pile up behind it. Where steps of one size cost
more than of another, both lose the same *time*, not the same number of steps.

A pure function of the requests' bookkeeping and the time: the tests drive it with a fake clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence


@dataclass
class Progress:
    """A running request's time since it arrived."""

    arrived_at: float
    stepped_s: float = 0.0  # time of the steps it took part in
    steps: int = 0

    def lost(self, now: float) -> float:
        return now - self.arrived_at - self.stepped_s

    def stepped(self, seconds: float) -> None:
        self.stepped_s += seconds
        self.steps += 1


def next_set(sets: Mapping[Hashable, Sequence[Progress]], now: float) -> Hashable:
    """The set the next step advances (``sets``: each non-empty set's requests)."""
    fresh = [key for key, members in sets.items() if not any(p.steps for p in members)]
    if fresh:
        return min(fresh, key=lambda key: min(p.arrived_at for p in sets[key]))
    return max(sets, key=lambda key: max(p.lost(now) for p in sets[key]))
