"""Placement counts adapter slots as it counts cost: an executor is sent a request only if the
request's adapters fit beside those its running requests hold (--max-loras), so no request waits
inside an executor while the scheduler counts it as running there."""

from __future__ import annotations

from diffserve.wire.protocol import STEP_MODE
from diffserve.scheduler.core import SchedulerCore
from helpers import make_request, run, taken


def core(executors: int = 1, max_loras: int = 2) -> SchedulerCore:
    c = SchedulerCore(8, 0.0, executors, mode=STEP_MODE, max_loras=max_loras)
    for i in range(executors):
        c.executor_ready(i, 0.0)
    return c


def lora(rid: str, *names: str):
    return make_request(request_id=rid, loras=[(n, 1.0) for n in names])


def test_a_request_whose_adapters_do_not_fit_waits_in_the_queue_until_a_slot_frees():
    c = core()
    c.add(lora("a", "A"), [], 0.0)
    c.add(lora("b", "B"), [], 0.0)
    (first,) = c.dispatch(0.0)
    assert taken([first]) == [[("a", 0, 1), ("b", 0, 1)]]
    c.add(lora("c", "C"), [], 0.1)
    c.add(lora("a2", "A"), [], 0.1)  # fits, but the head (c) does not: nothing passes it
    assert c.dispatch(0.1) == [] and c.num_waiting == 2
    run(c, first, only={"a"}, now=0.2)  # A's only holder leaves: a slot for C
    (joined,) = c.dispatch(0.2)
    assert taken([joined]) == [[("c", 0, 1)]]  # B and C held: A has no slot again yet
    run(c, first, only={"b"}, now=0.3)
    (joined,) = c.dispatch(0.3)
    assert taken([joined]) == [[("a2", 0, 1)]]


def test_a_group_stops_at_the_first_request_whose_adapters_do_not_fit():
    c = core()
    for rid, names in (("x", "A"), ("y", "B"), ("z", "C"), ("w", "A")):
        c.add(lora(rid, *names), [], 0.0)
    (d,) = c.dispatch(0.0)
    assert taken([d]) == [[("x", 0, 1), ("y", 0, 1)]]  # z needs a third slot; w keeps its place
    assert list(c.batcher.waiting_ids()) == ["z", "w"]


def test_the_head_goes_to_an_executor_that_has_slots_for_its_adapters():
    c = core(executors=2)
    c.add(lora("a", "A", "B"), [], 0.0)
    c.add(make_request(request_id="heavy", width=128, cost=4.0), [], 0.0)
    placed = {item.request.request_id: d.executor for d in c.dispatch(0.0) for item in d.work.items}
    assert placed == {"a": 0, "heavy": 1}
    c.add(lora("other", "C", "D"), [], 0.1)
    (d,) = c.dispatch(0.1)
    # Executor 0 is the less loaded, but it holds A and B: C and D do not fit beside them.
    assert d.executor == 1


def test_adapters_are_not_counted_without_a_limit():
    c = core(max_loras=0)
    for i in range(5):
        c.add(lora(f"r{i}", f"L{i}"), [], 0.0)
    (d,) = c.dispatch(0.0)
    assert len(d.work.items) == 5
