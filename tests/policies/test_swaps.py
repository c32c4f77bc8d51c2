"""The swap policy, driven with a fake clock and request counts."""

import pytest

from diffserve.policies.swaps import Swap, SwapPolicy


def policy(limit=2, budget=0, wait=5.0, sizes=(100, 100, 100)):
    p = SwapPolicy(["a", "b", "c"], limit, budget, wait)
    for name, size in zip("abc", sizes):
        p.loaded(name, size, 0.0)
    return p


def test_at_start_the_last_models_past_the_limit_sleep():
    p = policy()
    assert p.over_budget() == Swap(("c",), None)
    p.done(Swap(("c",), None), 0.0, ("c",), False)
    assert p.over_budget() is None
    assert [m.name for m in p.models.values() if m.resident] == ["a", "b"]


def test_a_byte_budget_bounds_the_awake_models_too():
    p = policy(limit=0, budget=250, sizes=(100, 100, 100))
    assert p.over_budget() == Swap(("c",), None)


def asleep_c(**kw):
    p = policy(**kw)
    p.done(p.over_budget(), 0.0, ("c",), False)
    return p


def test_an_idle_resident_model_makes_room_least_recently_used_first():
    p = asleep_c()
    p.observe("a", 1, 1.0)
    p.observe("a", 0, 2.0)  # a was used at 1.0; b never
    p.observe("c", 3, 3.0)
    assert p.next_swap(3.0) == Swap(("b",), "c")
    assert p.next_swap(3.0) is None  # one swap at a time
    p.done(Swap(("b",), "c"), 3.5, ("b",), True)
    assert {m.name for m in p.models.values() if m.resident} == {"a", "c"}


def test_busy_models_serve_their_queues_until_the_bound_then_the_oldest_gives_way():
    p = asleep_c(wait=5.0)
    p.observe("a", 4, 1.0)
    p.observe("b", 4, 1.0)
    p.observe("c", 2, 2.0)
    assert p.next_swap(2.0) is None
    assert p.time_until_decision(4.0) == 3.0
    assert p.next_swap(6.9) is None
    p.observe("b", 0, 6.9)  # b went idle within the bound: it makes room, not the busy a
    assert p.next_swap(7.0) == Swap(("b",), "c")


def test_past_the_bound_the_model_resident_longest_is_swapped_out():
    p = asleep_c(wait=5.0)
    p.loaded("b", 100, 0.5)  # b woke later than a
    p.observe("a", 4, 1.0)
    p.observe("b", 4, 1.0)
    p.observe("c", 2, 2.0)
    assert p.next_swap(7.0) == Swap(("a",), "c")
    p.done(Swap(("a",), "c"), 8.0, ("a",), True)
    assert p.models["a"].waiting_since == 8.0  # its queue now waits, bounded the same way


def test_room_without_eviction_and_no_demand_no_swap():
    p = policy(limit=3)
    p.done(Swap(("c",), None), 0.0, ("c",), False)  # asleep, as after a swap
    assert p.next_swap(1.0) is None
    p.observe("c", 1, 1.0)
    assert p.next_swap(1.0) == Swap((), "c")


def test_the_model_waiting_longest_goes_first_and_failed_models_take_no_part():
    p = policy(limit=1)
    p.done(p.over_budget(), 0.0, ("c", "b"), False)
    p.failed("a", "could not load")
    p.observe("c", 1, 1.0)
    p.observe("b", 1, 2.0)
    assert p.next_swap(2.0) == Swap((), "c")


def test_a_failed_wake_leaves_the_model_asleep_and_asks_again():
    p = asleep_c()
    p.observe("c", 1, 1.0)
    swap = p.next_swap(1.0)
    p.done(swap, 1.5, (), False)  # the executor died during the swap: nothing changed
    assert not p.models["c"].resident
    assert p.next_swap(2.0) == swap


def test_a_model_idle_only_briefly_stays_for_the_rest_of_its_burst():
    p = asleep_c(wait=5.0)  # grace: 0.5 s
    p.observe("a", 2, 1.0)
    p.observe("b", 2, 1.0)
    p.observe("c", 1, 1.0)
    p.observe("a", 0, 2.0)  # a's burst may not be over
    assert p.next_swap(2.2) is None
    assert p.time_until_decision(2.2) == pytest.approx(0.3)
    p.observe("a", 1, 2.3)  # it was not: a stays
    p.observe("a", 0, 3.0)
    assert p.next_swap(3.4) is None
    assert p.next_swap(3.5) == Swap(("a",), "c")


def test_the_grace_can_be_set():
    p = SwapPolicy(["a", "b"], 1, max_wait_s=5.0, idle_grace_s=0.0)
    p.loaded("a", 1, 0.0)
    p.observe("a", 1, 1.0)
    p.observe("a", 0, 1.5)
    p.observe("b", 1, 1.5)
    assert p.next_swap(1.5) == Swap(("a",), "b")


def test_past_the_host_budget_a_model_put_to_sleep_goes_to_disk():
    p = SwapPolicy(["a", "b", "c"], 1, max_wait_s=5.0, idle_grace_s=0.0, host_budget_bytes=150)
    for name in "abc":
        p.loaded(name, 100, 0.0)
    start = p.over_budget()  # c sleeps first: it fits in host memory; b does not, beside it
    assert start == Swap(("c", "b"), None, ("b",))
    p.done(start, 0.0, ("c", "b"), False)
    assert (p.models["c"].on_disk, p.models["b"].on_disk) == (False, True)
    p.observe("b", 1, 1.0)  # b's requests: a (idle) makes room, and host memory is full
    swap = p.next_swap(1.0)
    assert swap == Swap(("a",), "b", ("a",))
    p.done(swap, 1.5, ("a",), True)
    assert p.models["a"].on_disk and not p.models["b"].on_disk
    p.observe("b", 0, 2.0)
    p.observe("c", 1, 2.0)  # c wakes from host memory: b, put to sleep, now fits there
    swap = p.next_swap(2.0)
    assert swap == Swap(("b",), "c", ())
    p.done(swap, 2.5, ("b",), True)
    assert [p.models[n].on_disk for n in "abc"] == [True, False, False]


def test_without_a_host_budget_nothing_goes_to_disk():
    p = asleep_c(limit=1)
    assert p.over_budget() == Swap(("b",), None)
    assert p.to_disk(["a", "b"]) == ()


def test_the_host_budget_counts_every_executors_copy():
    p = SwapPolicy(["a", "b"], 1, host_budget_bytes=150, host_copies=2)  # two executors each
    p.loaded("a", 100, 0.0)
    p.loaded("b", 100, 0.0)
    assert p.over_budget() == Swap(("b",), None, ("b",))  # 2 x 100 bytes do not fit in 150
