"""Oldest first (--set-policy oldest), on the fake-clock executor of test_srpt: sizes run in
arrival order, a request of the running size joins it at once, and a size whose requests keep
coming does not hold up one that arrived before them."""

from __future__ import annotations

import pytest

from policies.test_srpt import Executor, rare_beside_a_busy_size


def test_sizes_run_in_arrival_order_one_after_the_other():
    ex = Executor("oldest", {"a": 0.05, "b": 0.05})
    ex.admit("a", 20)
    ex.admit("b", 20)
    ex.run()
    assert ex.order == ["a"] * 20 + ["b"] * 20
    assert sorted(ex.done.values()) == pytest.approx([1.0, 2.0])


def test_a_request_of_the_running_size_joins_and_a_later_size_waits_its_turn():
    ex = Executor("oldest", {"a": 0.05, "b": 0.05})
    first = ex.admit("a", 10)
    for _ in range(3):
        ex.step()
    late = ex.admit("b", 10)
    ex.step()
    joiner = ex.admit("a", 10)  # arrives after "b"
    ex.step()
    assert ex.order[-2:] == ["a", "a"] and joiner.steps == 1  # joined the running set at once
    while first.remaining:
        ex.step()
    ex.step()
    assert ex.order[-1] == "b" and late.steps == 1  # older than what is left of "a"


def test_a_busy_size_does_not_starve_an_older_request_of_another():
    ex, rare = rare_beside_a_busy_size("oldest", steps=200)
    assert not rare.remaining
    # It waited for the 4 requests before it (9 steps left at 0.04 s), then ran alone.
    assert ex.done[id(rare)] == pytest.approx(9 * 0.04 + 10 * 0.02)
