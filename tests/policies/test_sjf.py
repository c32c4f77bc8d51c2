"""Shortest job first behind the queue-policy seam: the batcher and the scheduler core take the
policy they are given, and the head is the request with the least work."""

from __future__ import annotations

from diffserve.policies import QUEUE_POLICIES, queue_policy
from diffserve.wire.protocol import STEP_MODE
from diffserve.scheduler.batcher import Batcher
from diffserve.scheduler.core import SchedulerCore
from helpers import make_request


def order(batcher: Batcher) -> list[str]:
    taken = []
    while (batch := batcher.next_batch(100.0, force=True, room=1)) is not None:
        taken += [s.request.request_id for s in batch]
    return taken


def test_the_registry_names_every_policy_once():
    assert set(QUEUE_POLICIES) == {"fcfs", "sjf", "priority"}
    assert all(cls.name == name for name, cls in QUEUE_POLICIES.items())


def test_the_head_is_the_request_with_the_least_work_ties_by_arrival():
    b = Batcher(8, 0.0, STEP_MODE, policy=queue_policy("sjf"))
    b.add(make_request(request_id="long", steps=24), now=0.0)
    b.add(make_request(request_id="two-images", n=2, steps=4), now=0.1)  # work 8
    b.add(make_request(request_id="short", steps=4), now=0.2)
    b.add(make_request(request_id="short-later", steps=4), now=0.3)
    b.add(make_request(request_id="big", steps=4, cost=4.0), now=0.4)  # work 16
    assert b.head_id() == "short"
    assert order(b) == ["short", "short-later", "two-images", "two-images", "big", "long"]


def test_fcfs_keeps_arrival_order_whatever_the_work():
    b = Batcher(8, 0.0, STEP_MODE, policy=queue_policy("fcfs"))
    for i, steps in enumerate((24, 4, 12)):
        b.add(make_request(request_id=f"r{i}", steps=steps), now=float(i))
    assert order(b) == ["r0", "r1", "r2"]


def test_the_core_dispatches_the_shortest_first_and_its_company_in_policy_order():
    core = SchedulerCore(max_batch_size=2, max_delay_s=0.0, mode=STEP_MODE,
                         policy=queue_policy("sjf"))
    core.executor_ready(0, 0.0)
    core.add(make_request(request_id="busy", steps=50, width=128), [], 0.0)
    core.dispatch(0.0)  # the executor is busy with another size from now on
    for rid, steps in (("a", 30), ("b", 10), ("c", 20)):
        core.add(make_request(request_id=rid, steps=steps), [], 0.1)
    (d,) = core.dispatch(0.2)  # a new set of the 64x64 size, two images of room
    assert [item.request.request_id for item in d.work.items] == ["b", "c"]
    assert all(item.batch_key == item.request.batch_key(STEP_MODE) for item in d.work.items)
