"""The time-fair set choice (the default --set-policy), with a fake clock and step costs: a new
size starts at the next step, a lone rare size is not starved by a busy common one, the busy one
is not halted by it, and a size whose requests waited longer for room catches up."""

from __future__ import annotations

from diffserve.policies import set_policy
from diffserve.policies.base import Member

choose = set_policy("fair").choose


class Executor:
    """Steps the sets the rule picks; each step of a set costs its cost per step."""

    def __init__(self, step_cost: dict[str, float]) -> None:
        self.cost, self.now = step_cost, 0.0
        self.sets: dict[str, list[Member]] = {}
        self.order: list[str] = []

    def admit(self, size: str, waited: float = 0.0) -> Member:
        p = Member(self.now - waited)  # it arrived ``waited`` before its admission
        self.sets.setdefault(size, []).append(p)
        return p

    def step(self, steps_per_request: int = 1000) -> str:
        size = choose({k: v for k, v in self.sets.items() if v}, self.now)
        self.now += self.cost[size]
        for p in self.sets[size]:
            p.stepped(self.cost[size])
        self.sets[size] = [p for p in self.sets[size] if p.steps < steps_per_request]
        self.order.append(size)
        return size


def test_a_new_size_starts_at_the_next_step():
    ex = Executor({"common": 0.04, "rare": 0.02})
    for _ in range(8):
        ex.admit("common")
    for _ in range(10):
        ex.step()
    ex.admit("rare")
    assert ex.step() == "rare"


def test_a_lone_rare_size_is_not_starved_by_a_saturating_common_size():
    ex = Executor({"common": 0.04, "rare": 0.02})
    for _ in range(8):
        ex.admit("common")
    ex.step()
    rare = ex.admit("rare")
    for _ in range(200):
        ex.step()
        while len(ex.sets["common"]) < 8:  # the common size never lets up
            ex.admit("common")
    gaps, last = [], None
    for i, size in enumerate(ex.order[1:]):
        if size == "rare":
            if last is not None:
                gaps.append(i - last)
            last = i
    assert max(gaps) <= 4  # a bounded number of steps between two of its steps
    # Both lose the same time to the other: the cheaper rare steps come twice as often here.
    common_member = ex.sets["common"][0]
    assert abs(rare.lost(ex.now) - common_member.lost(ex.now)) <= 0.04 + 0.02
    share = ex.order.count("rare") / len(ex.order)
    assert 0.5 < share < 0.75


def test_the_busy_size_is_not_halted_and_shares_follow_time_not_steps():
    ex = Executor({"a": 0.01, "b": 0.03})
    for size in ("a", "b"):
        ex.admit(size)
    for _ in range(400):
        ex.step()
    time_a = ex.order.count("a") * 0.01
    time_b = ex.order.count("b") * 0.03
    # Each request loses the same time: each set has the executor about half of the time.
    assert abs(time_a - time_b) / (time_a + time_b) < 0.05
    assert max(len(run) for run in "".join(ex.order).split("b")) <= 4  # no long stretch of "a"


def test_the_oldest_new_set_goes_first_among_new_ones():
    ex = Executor({"x": 0.01, "y": 0.01})
    ex.admit("y")
    ex.now = 1.0
    ex.admit("x")
    assert ex.step() == "y" and ex.step() == "x"


def test_a_size_whose_requests_waited_longer_for_room_gets_the_steps_until_they_catch_up():
    """A request's time counts from its arrival: where one size's requests waited a second
    longer in the queue (its set is the bottleneck), that set takes the steps until they have
    lost no more than the others, so the queue does not pile up behind it."""
    ex = Executor({"big": 0.05, "small": 0.05})
    ex.now = 10.0
    for _ in range(8):
        ex.admit("small")
    late = ex.admit("big", waited=1.0)
    for _ in range(24):
        ex.step()
    assert ex.order[:2] == ["big", "small"]  # both new: the older first, then the other at once
    assert ex.order[2:21] == ["big"] * 19  # a second to catch up: 20 steps of 50 ms
    assert "small" in ex.order[21:]
    assert abs(late.lost(ex.now) - ex.sets["small"][0].lost(ex.now)) <= 0.05
