"""Priority classes with aging, through the batcher: the best class first, ties by arrival, and
the stated bound: a request of class p that entered at t goes ahead of every request of class q
that enters after t + (p - q) x aging_s."""

from __future__ import annotations

import pytest

from diffserve.policies import queue_policy
from diffserve.wire.protocol import STEP_MODE
from diffserve.scheduler.batcher import Batcher
from helpers import make_request


def request(rid: str, priority: int):
    return make_request(request_id=rid, steps=4, priority=priority)


def order(batcher: Batcher) -> list[str]:
    taken = []
    while (batch := batcher.next_batch(1e9, force=True, room=1)) is not None:
        taken += [s.request.request_id for s in batch]
    return taken


def test_the_best_class_goes_first_and_ties_go_by_arrival():
    b = Batcher(8, 0.0, STEP_MODE, policy=queue_policy("priority", aging_s=0))
    for rid, priority, at in (("batch", 10, 0.0), ("mid", 5, 1.0), ("now", 0, 2.0), ("now2", 0, 3.0)):
        b.add(request(rid, priority), now=at)
    assert order(b) == ["now", "now2", "mid", "batch"]


@pytest.mark.parametrize("gap", [0.5, 1.5])
def test_aging_bounds_how_long_a_worse_class_is_passed(gap):
    """aging_s = 1: a class-10 request is passed by class-0 requests that arrive within 10 s of
    it, and by none that arrive later."""
    b = Batcher(8, 0.0, STEP_MODE, policy=queue_policy("priority", aging_s=1.0))
    b.add(request("batch", 10), now=0.0)
    b.add(request("inside", 0), now=10.0 - gap)
    b.add(request("outside", 0), now=10.0 + gap)
    assert order(b) == ["inside", "batch", "outside"]


def test_no_class_starves_under_a_steady_stream_of_better_ones():
    b = Batcher(8, 0.0, STEP_MODE, policy=queue_policy("priority", aging_s=0.5))
    b.add(request("batch", 4), now=0.0)
    served, t = [], 0.0
    for i in range(40):  # a class-0 request every 0.1 s, one served every 0.1 s
        t += 0.1
        b.add(request(f"i{i}", 0), now=t)
        served += [s.request.request_id for s in b.next_batch(t, force=True, room=1)]
    # Only those that arrived within 4 x 0.5 = 2 s after it pass it.
    assert served.index("batch") <= 20
