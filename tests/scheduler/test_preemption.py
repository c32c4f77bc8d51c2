"""Preemption at step boundaries, in the scheduler core with a fake clock: a request that cannot
start for want of room pauses running items of worse classes (the worst, then the youngest, as
few as will do), its work goes after the pause, and a paused item resumes on its own executor
ahead of newer requests of its class; what ends, aborts or dies meanwhile is settled."""

from __future__ import annotations

from diffserve.policies import queue_policy
from diffserve.wire.protocol import FINISHED, STEP_MODE, ItemResult, ItemsDone
from diffserve.scheduler.core import SchedulerCore
from helpers import make_request, run, taken


def core(policy="priority", max_size=2, executors=1) -> SchedulerCore:
    c = SchedulerCore(max_size, 0.0, executors, mode=STEP_MODE,
                      policy=queue_policy(policy, **({"aging_s": 0} if policy == "priority" else {})))
    for i in range(executors):
        c.executor_ready(i, 0.0)
    return c


def add(c, rid: str, priority: int, at: float, **kw):
    c.add(make_request(request_id=rid, priority=priority, steps=20, **kw), [], at)


def test_a_better_class_pauses_the_worst_and_youngest_running_item():
    c = core()
    add(c, "old", 10, 0.0)
    add(c, "mid", 5, 0.1)
    (first,) = c.dispatch(0.2)
    assert taken([first]) == [[("mid", 0, 1), ("old", 0, 1)]]  # the better class first
    add(c, "young", 10, 0.3)  # waits: the set is full
    add(c, "urgent", 0, 0.4)
    (joined,) = c.dispatch(0.4)
    assert c.take_pauses() == [(0, [("old", 0)])]  # class 10 before class 5
    assert taken([joined]) == [[("urgent", 0, 1)]]
    assert c.num_paused == 1 and c.num_waiting == 1 and c.preemptions == 1
    assert list(c.batcher.waiting_ids()) == ["young"]


def test_the_youngest_of_the_worst_class_is_paused_first():
    c = core()
    add(c, "a", 10, 0.0)
    add(c, "b", 10, 0.1)
    c.dispatch(0.2)
    add(c, "urgent", 0, 0.3)
    c.dispatch(0.3)
    assert c.take_pauses() == [(0, [("b", 0)])]


def test_a_paused_item_resumes_on_its_executor_ahead_of_newer_requests_of_its_class():
    c = core()
    add(c, "low1", 10, 0.0)
    add(c, "low2", 10, 0.1)
    (first,) = c.dispatch(0.2)
    add(c, "urgent", 0, 0.3)
    (second,) = c.dispatch(0.3)
    c.take_pauses()
    add(c, "newer", 10, 0.4)  # the same class, later than the paused one's arrival
    assert c.dispatch(0.5) == []  # no room yet
    run(c, second, now=1.0)  # the urgent one is done: room for one
    (resumed,) = c.dispatch(1.0)
    (item,) = resumed.work.items
    assert (item.request.request_id, item.resume, resumed.frames) == ("low2", True, [])
    assert c.num_paused == 0 and list(c.batcher.waiting_ids()) == ["newer"]


def test_nothing_is_paused_for_an_equal_or_worse_class_or_under_fcfs():
    for policy, priority in (("priority", 10), ("fcfs", 0)):
        c = core(policy)
        add(c, "a", 10, 0.0)
        add(c, "b", 10, 0.1)
        c.dispatch(0.2)
        add(c, "next", priority, 0.3)
        assert c.dispatch(0.3) == [] and c.take_pauses() == [] and c.num_paused == 0


def test_an_item_that_ends_before_its_pause_arrives_is_answered_and_not_resumed():
    c = core()
    add(c, "low", 10, 0.0)
    add(c, "low2", 10, 0.1)
    (first,) = c.dispatch(0.2)
    add(c, "urgent", 0, 0.3)
    c.dispatch(0.3)
    assert c.take_pauses() == [(0, [("low2", 0)])]
    # The executor had finished it at the step before the pause reached it.
    (done,) = c.complete(0, ItemsDone([ItemResult("low2", 0, 1, FINISHED, 0.1)]), 0.4)
    assert done.done.request_id == "low2"
    assert c.num_paused == 0 and c.batcher.paused_count == 0


def test_aborting_a_paused_request_cancels_it_where_its_state_is():
    c = core(executors=1)
    add(c, "low", 10, 0.0)
    add(c, "low2", 10, 0.1)
    c.dispatch(0.2)
    add(c, "urgent", 0, 0.3)
    c.dispatch(0.3)
    c.take_pauses()
    assert c.abort("low2")
    assert [(i, cancel.request_ids) for i, cancel in c.take_cancels()] == [(0, ["low2"])]
    assert c.num_paused == 0 and c.batcher.paused_count == 0


def test_losing_the_executor_runs_its_paused_items_again_too():
    """Nothing of them was emitted: all three start over from the queue, the paused ones no
    longer pinned to the executor that held their state."""
    c = core()
    add(c, "low", 10, 0.0)
    add(c, "low2", 10, 0.1)
    c.dispatch(0.2)
    add(c, "urgent", 0, 0.3)
    c.dispatch(0.3)
    assert c.executor_lost(0, "gone", 0.5) == []
    assert c.num_paused == 0 and c.batcher.paused_count == 0
    assert sorted(c.batcher.waiting_ids()) == ["low", "low2", "urgent"]
    c.executor_ready(0, 0.6)
    assert {i.request.request_id for d in c.dispatch(0.6) for i in d.work.items} >= {"urgent"}
