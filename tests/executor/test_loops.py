"""The executor's request-mode loop around a real runner (tiny-sd), its messages given in
order by an in-memory stand-in for the executor's sockets: what arrives during a pipeline call
waits for the loop, except cancels; and no cancel outlives the requests it concerns."""

from __future__ import annotations

from collections import deque

import pytest

from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.loops import RequestLoop, StepLoop
from diffserve.executor.request.runner import RequestRunner
from diffserve.wire.protocol import Cancel, Kind
from diffserve.wire.request import Work, WorkItem
from helpers import make_request


class MemoryIO:
    """The executor's sockets, in memory: ``inbox`` is read in order; ``during_call`` is
    delivered once the first pipeline call has started."""

    def __init__(self, inbox: list, during_call: list = ()) -> None:
        self.inbox = deque(inbox)
        self.during_call = list(during_call)
        self.sent: list = []  # (work item key, status) of every outcome, in order
        self.calls: list[bool] = []  # each call: was it interrupted

    def receive(self, block: bool):
        if self.inbox:
            return self.inbox.popleft()
        assert not block, "the loop waits for a message that never comes"
        return None

    def send_outcomes(self, outcomes) -> None:
        self.sent += [(o.item.request.request_id, o.status) for o in outcomes]

    def send_partial(self, partial) -> None:
        pass

    def send_progress(self, *progress) -> None:
        pass

    def count_call(self, seconds: float, interrupted: bool) -> None:
        self.calls.append(interrupted)

    def count_resident(self, adapters) -> None:
        pass

    def count_memory(self, running_cost: float) -> None:
        pass


@pytest.fixture(scope="module")
def runner_parts():
    loaded = load_model("tiny-sd", torch_threads=1)
    pipelines = task_pipelines(loaded.pipe)
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    return loaded, pipelines, family


def loop_for(runner_parts, io: MemoryIO) -> RequestLoop:
    loaded, pipelines, family = runner_parts

    def make(interrupt, emit, progress):
        def interrupt_and_deliver():
            io.inbox.extend(io.during_call)  # arrives while the call runs
            io.during_call = []
            return interrupt()

        return RequestRunner(loaded, pipelines, family, should_interrupt=interrupt_and_deliver,
                             emit_partial=emit)

    return RequestLoop(make, io)


def work(work_id: int, *request_ids: str) -> tuple:
    items = [WorkItem(make_request(request_id=rid, steps=3), 0, 1) for rid in request_ids]
    return (Kind.WORK, Work(work_id, items), [])


SHUTDOWN = (Kind.SHUTDOWN, None, [])


def cancel(*request_ids: str) -> tuple:
    return (Kind.CANCEL, Cancel(list(request_ids)), [])


def test_work_and_shutdown_arriving_during_a_call_wait_for_it_to_finish(runner_parts):
    io = MemoryIO([work(1, "a")], during_call=[work(2, "b"), SHUTDOWN])
    loop = loop_for(runner_parts, io)
    loop.run()
    # "a" ran to the end (a shutdown is not a departed caller), then "b", then the loop stopped.
    assert io.sent == [("a", "finished"), ("b", "finished")]
    assert io.calls == [False, False]


def test_a_call_stops_once_every_caller_has_gone(runner_parts):
    io = MemoryIO([work(1, "a", "b"), SHUTDOWN], during_call=[cancel("a", "b")])
    loop_for(runner_parts, io).run()
    assert io.sent == [("a", "cancelled"), ("b", "cancelled")] and io.calls == [True]


def test_cancels_are_kept_only_for_requests_running_or_waiting_here(runner_parts):
    stale = [f"finished-long-ago-{i}" for i in range(1000)]
    io = MemoryIO([cancel(*stale), work(1, "a")],
                  during_call=[work(2, "queued"), cancel("queued", *stale), SHUTDOWN])
    loop = loop_for(runner_parts, io)
    loop.run()
    # The cancel of the waiting request counts (its call stops at once); the stale ones are not
    # remembered, then or later.
    assert io.sent == [("a", "finished"), ("queued", "cancelled")]
    assert loop.cancelled == set()


class StepIO(MemoryIO):
    def count_step(self, out) -> None:
        pass

    def count_admission(self, seconds: float, admitted: int) -> None:
        pass


def shut_down_when_done(engine, io: MemoryIO, step) -> None:
    """The engine steps with ``step``; once it holds nothing, the loop is told to shut down."""
    def stepped():
        out = step()
        if not engine:
            io.inbox.append(SHUTDOWN)
        return out
    engine.step = stepped


def test_a_step_that_raises_outside_any_request_fails_what_it_held_and_the_loop_serves_on(
        runner_parts):
    """A bug in the engine itself (not a request's stage, which the engine isolates) costs what
    the engine held, not the executor: the next work runs on the same loaded model."""
    from diffserve.executor.step.engine import StepEngine

    loaded, pipelines, family = runner_parts
    engine = StepEngine(family)
    io = StepIO([work(1, "a", "b")])
    real_step, steps = engine.step, []

    def step():
        steps.append(len(steps))
        if len(steps) == 1:
            io.inbox.append(work(2, "c"))  # arrives while the broken step runs
            raise AssertionError("an engine bug")
        return real_step()

    shut_down_when_done(engine, io, step)
    StepLoop(engine, io).run()
    assert io.sent == [("a", "failed"), ("b", "failed"), ("c", "finished")]
    assert not engine


def test_a_cancel_read_with_its_work_in_one_drain_still_cancels_it(runner_parts):
    """The work and its cancel arrive between two steps (a caller that hung up at once, or a busy
    executor): the cancel is applied after the work is admitted, not dropped as unknown."""
    from diffserve.executor.step.engine import StepEngine

    loaded, pipelines, family = runner_parts
    engine = StepEngine(family)
    io = StepIO([work(1, "a", "b"), cancel("a")])
    shut_down_when_done(engine, io, engine.step)
    StepLoop(engine, io).run()
    assert sorted(io.sent) == [("a", "cancelled"), ("b", "finished")]
