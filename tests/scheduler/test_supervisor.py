"""Executor supervision with real processes that exit at once: restarts, identities, and giving
up on an executor that never gets as far as loading its model."""

from __future__ import annotations

from diffserve import processes
from diffserve.scheduler.supervisor import FAILED, MAX_FAILED_STARTS, READY, RESTARTING, ExecutorSupervisor
from helpers import exit_with


def supervisor(count: int = 2) -> ExecutorSupervisor:
    def start(index: int, device: str, identity: bytes):
        return processes.start(exit_with, 3, f"test-executor-{index}")

    s = ExecutorSupervisor(["cpu"] * count, start)
    s.start_all()
    return s


def test_a_dead_ready_executor_restarts_under_a_new_identity():
    s = supervisor()
    first = s.identity(1)
    assert s.index_of(first) == 1 and s.index_of(b"1:99") is None
    s.loaded(1, "cpu")
    death = s.died(1)
    assert (death.exit_code, death.was_ready, death.restarted) == (3, True, True)
    assert s.identity(1) != first and s.index_of(first) is None  # the old one's messages are dropped
    state = s.states()[1]
    assert (state.state, state.restarts) == (RESTARTING, 1)
    s.loaded(1, "cpu")
    assert s.states()[1].state == READY


def test_an_executor_that_keeps_dying_before_it_loads_is_given_up():
    s = supervisor()
    for attempt in range(1, MAX_FAILED_STARTS + 1):
        death = s.died(0)
        assert death.restarted == (attempt < MAX_FAILED_STARTS)
    assert s.states()[0].state == FAILED and not s.all_failed()
    assert s.index_of(s.identity(0)) is None
    assert set(s.sentinels().values()) == {1}  # only executor 1 is still watched
    s.died(1, restart=False)
    assert s.all_failed()
