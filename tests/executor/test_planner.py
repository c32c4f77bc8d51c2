"""The plan of a step, with a fake clock: who leaves, who joins, which set advances."""

from __future__ import annotations

from diffserve.executor.step.planner import Planned, Planner
from diffserve.policies import set_policy
from diffserve.policies.base import Member


def entry(rid: str, key: str, arrived: float = 0.0, steps: int = 0, ready: bool = True) -> Planned:
    member = Member(arrived, total_steps=10)
    for _ in range(steps):
        member.stepped(0.1)
    return Planned(rid, key, member, ready)


def test_cancelled_requests_leave_whether_running_or_waiting():
    plan = Planner(set_policy("fair")).plan(
        [entry("a", "64"), entry("b", "64")], [entry("w", "32")], {"b", "w"}, now=1.0)
    assert sorted(plan.leave) == ["b", "w"] and plan.join == [] and plan.advance == "64"


def test_waiting_requests_join_once_their_adapters_fit_and_their_new_set_goes_first():
    planner = Planner(set_policy("fair"))
    running = [entry("a", "64", steps=3)]
    plan = planner.plan(running, [entry("w", "32", arrived=0.5, ready=False)], set(), now=1.0)
    assert plan.join == [] and plan.advance == "64"  # nothing waits for a set that cannot open
    plan = planner.plan(running, [entry("w", "32", arrived=0.5)], set(), now=1.0)
    assert plan.join == ["w"] and plan.advance == "32"  # a new set starts at the next step


def test_nothing_to_plan():
    plan = Planner(set_policy("fair")).plan([], [], set(), now=0.0)
    assert (plan.leave, plan.join, plan.advance) == ([], [], None)
