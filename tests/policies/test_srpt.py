"""Soonest completion first (--set-policy srpt), with a fake clock and step costs: it finishes
one set before the other where time-fair choice shares them, lowering the mean; and its bound
holds: no request loses more than its own processing time (patience 1)."""

from __future__ import annotations

import statistics

import pytest

from diffserve.policies import set_policy
from diffserve.policies.base import Member


class Executor:
    """Steps the sets a policy picks; a step of a set costs its cost, members leave when done."""

    def __init__(self, policy: str, cost: dict[str, float]) -> None:
        self.choose, self.cost, self.now = set_policy(policy).choose, cost, 0.0
        self.sets: dict[str, list[Member]] = {}
        self.done: dict[int, float] = {}  # id(member) -> latency
        self.order: list[str] = []

    def admit(self, size: str, steps: int) -> Member:
        member = Member(self.now, steps)
        self.sets.setdefault(size, []).append(member)
        return member

    def step(self) -> None:
        size = self.choose({k: v for k, v in self.sets.items() if v}, self.now)
        self.now += self.cost[size]
        self.order.append(size)
        for m in self.sets[size]:
            m.stepped(self.cost[size])
            if not m.remaining:
                self.done[id(m)] = self.now - m.arrived_at
        self.sets[size] = [m for m in self.sets[size] if m.remaining]

    def run(self) -> None:
        while any(self.sets.values()):
            self.step()


def rare_beside_a_busy_size(policy: str, steps: int = 300) -> tuple[Executor, Member]:
    """Four requests of a common size (0.04 s a step) run a step; a rare size's request (0.02 s)
    arrives; then ``steps`` steps, the common set kept at four by newcomers that never let up."""
    ex = Executor(policy, {"common": 0.04, "rare": 0.02})
    for _ in range(4):
        ex.admit("common", 10)
    ex.step()
    rare = ex.admit("rare", 10)
    for _ in range(steps):
        ex.step()
        while len(ex.sets["common"]) < 4:
            ex.admit("common", 10)
    return ex, rare


def test_two_sets_of_equal_work_finish_one_after_the_other_not_both_late():
    latencies = {}
    for policy in ("fair", "srpt"):
        ex = Executor(policy, {"a": 0.05, "b": 0.05})
        ex.admit("a", 20)
        ex.admit("b", 20)
        ex.run()
        latencies[policy] = sorted(ex.done.values())
    assert latencies["fair"][0] > 1.9  # processor sharing: both finish near the end
    assert latencies["srpt"] == pytest.approx([1.0, 2.0])  # one alone, then the other
    assert statistics.mean(latencies["srpt"]) < 0.8 * statistics.mean(latencies["fair"])


def test_a_request_near_its_end_goes_before_a_set_that_just_started():
    ex = Executor("srpt", {"a": 0.05, "b": 0.05})
    nearly = ex.admit("a", 20)
    for _ in range(17):
        ex.step()
    ex.admit("b", 20)
    ex.step()
    ex.step()
    assert ex.order[-2:] == ["a", "a"] and nearly.remaining == 1


def test_no_request_loses_more_than_its_processing_time_at_the_pace_it_was_judged_by():
    """A rare size beside a common one whose newcomers never let up: it still starts, and it
    loses at most patience x its steps x its set's pace (a set that has not stepped yet is
    judged at the running sets' pace: here the common one's), plus one step of the other set."""
    ex, rare = rare_beside_a_busy_size("srpt")
    alone, judged = 10 * 0.02, 10 * 0.04
    assert id(rare) in ex.done
    assert ex.done[id(rare)] <= alone + judged + 0.04 + 1e-9
