"""The weight control's decisions (diffserve.scheduler.weight_updates), without processes: an update is
prepared everywhere before it is committed anywhere, a refusal is undone everywhere, drain waits
for the running work and abort does not, a commit that fails is undone where it was done, one
command at a time, sleeping holds the queue, and an executor that comes back catches up; and
the core's side: a held queue dispatches nothing, started requests are answered before new
weights, a sleeping server refuses where it is told to."""

from __future__ import annotations

from diffserve.wire.weight_commands import (
    ABORT_MODE,
    COMMIT,
    DISCARD,
    PATH,
    PREPARE,
    SHARED,
    SLEEP,
    SYNC,
    UPDATE,
    WAKE,
    WeightCommand,
    WeightResult,
    WeightSource,
)
from diffserve.wire.protocol import ItemResult, ItemsDone, FINISHED
from diffserve.scheduler.core import SchedulerCore
from diffserve.scheduler.weight_updates import ABORTED, TWO_VERSIONS, WeightControl
from helpers import make_request

SOURCE = WeightSource(PATH, "/weights/step-1")


def update(**kw) -> WeightCommand:
    return WeightCommand("u", UPDATE, kw.pop("source", SOURCE), **kw)


def ok(command_id: str = "u", **kw) -> WeightResult:
    return WeightResult(command_id, applied_at=kw.pop("applied_at", 5.0), **kw)


def steps(actions) -> list[tuple[int, str]]:
    return [(i, s.step) for i, s in actions.sends]


def test_an_update_is_prepared_everywhere_then_committed_and_versioned():
    w = WeightControl()
    a = w.begin(update(), [0, 1], busy=False)
    assert steps(a) == [(0, PREPARE), (1, PREPARE)] and a.hold is True and a.answer is None
    assert a.sends[0][1].sources == [SOURCE]
    assert w.answered(0, ok(full=True), busy=False).sends == []  # waits for executor 1
    a = w.answered(1, ok(full=True), busy=False)
    assert steps(a) == [(0, COMMIT), (1, COMMIT)] and a.fail_started == TWO_VERSIONS
    assert a.sends[0][1].version == "1"
    w.answered(0, ok(), busy=False)
    a = w.answered(1, ok(applied_at=6.0), busy=False)
    assert a.answer.status == 200 and a.answer.version == "1" and a.answer.applied_at == 6.0
    assert a.hold is False and a.changed and a.sync_others == {0, 1}
    assert w.version == "1" and w.sources == [SOURCE]
    # A partial update adds to the sources, a full one replaces them; the client may name it.
    w.begin(update(source=WeightSource(PATH, "/weights/part"), version="v-x"), [0], False)
    w.answered(0, ok(full=False), False)
    w.answered(0, ok(), False)
    assert w.version == "v-x" and [s.path for s in w.sources] == ["/weights/step-1", "/weights/part"]
    a = w.begin(update(), [0], False)
    assert a.answer.status == 400 and "name the new one" in a.answer.error  # "v-x" + 1?


def test_a_refusal_anywhere_is_discarded_everywhere_and_nothing_changes():
    w = WeightControl()
    shared = WeightSource(SHARED, "/dev/shm/x/update.safetensors")
    w.begin(update(source=shared), [0, 1], False)
    w.answered(0, ok(full=True), False)
    a = w.answered(1, WeightResult("u", 400, "transformer: 'x' is not a weight", "invalid_weights"), False)
    assert steps(a) == [(0, DISCARD)] and a.answer.status == 400 and a.hold is False
    assert a.delete == [shared.path] and w.version == "0" and w.sources == []


def test_drain_waits_for_running_work_and_abort_answers_it():
    w = WeightControl()
    w.begin(update(), [0], busy=True)
    a = w.answered(0, ok(full=True), busy=True)
    assert a.sends == [] and a.fail_started is None  # running work finishes on the old weights
    assert w.tick(busy=True).sends == []
    assert steps(w.tick(busy=False)) == [(0, COMMIT)]

    w = WeightControl()
    w.begin(update(mode=ABORT_MODE), [0], busy=True)
    a = w.answered(0, ok(full=True), busy=True)
    assert a.fail_started == ABORTED and steps(a) == [(0, COMMIT)]


def test_a_failed_commit_is_undone_where_it_was_done_and_one_command_runs_at_a_time():
    w = WeightControl()
    w.begin(update(), [0, 1], False)
    assert w.begin(WeightCommand("s", SLEEP), [0, 1], False).answer.status == 409
    w.answered(0, ok(full=True), False)
    w.answered(1, ok(full=True), False)
    w.answered(0, ok(), False)
    a = w.answered(1, WeightResult("u", 500, "RuntimeError: boom", "update_failed"), False)
    assert steps(a) == [(0, SYNC)] and a.sends[0][1].version == "0" and a.sends[0][1].sources == []
    assert a.answer.status == 500 and w.version == "0"


def test_sleep_holds_the_queue_after_the_running_work_and_an_executor_catches_up():
    w = WeightControl()
    a = w.begin(WeightCommand("s", SLEEP, level=2), [0], busy=True)
    assert a.hold is True and a.sends == []
    a = w.tick(busy=False)
    assert steps(a) == [(0, SLEEP)] and a.sends[0][1].level == 2
    a = w.answered(0, ok("s"), False)
    assert a.answer.sleeping == 2 and a.hold is True and w.sleeping == 2
    # An update while asleep: prepared and committed, the queue stays held.
    w.begin(update(), [0], False)
    w.answered(0, ok(full=True), False)
    a = w.answered(0, ok(), False)
    assert a.answer.status == 200 and a.hold is True and w.version == "1"
    assert [(s.step, s.version, s.level) for s in w.catch_up("c")] == [(SYNC, "1", 1), (SLEEP, "", 2)]
    a = w.begin(WeightCommand("w", WAKE), [0], False)
    assert steps(a) == [(0, WAKE)]
    a = w.answered(0, ok("w"), False)
    assert a.hold is False and w.sleeping == 0 and a.answer.sleeping == 0
    assert w.begin(WeightCommand("w2", WAKE), [0], False).answer.status == 200  # awake already


def test_an_executor_lost_meanwhile_leaves_the_others_to_finish():
    w = WeightControl()
    w.begin(update(), [0, 1], False)
    w.answered(0, ok(full=True), False)
    a = w.executor_lost(1, False)
    assert steps(a) == [(0, COMMIT)]
    a = w.answered(0, ok(), False)
    assert a.answer.status == 200 and a.sync_others == {0}  # 1 gets the state when it is back


def test_the_core_holds_its_queue_answers_started_requests_and_refuses_while_asleep():
    core = SchedulerCore(1, 0.0, num_executors=1)  # a request of 2 images goes in two parts
    core.executor_ready(0, 0.0)
    core.add(make_request(2, request_id="started"), [], 0.0)
    (d,) = core.dispatch(0.0)
    core.complete(0, ItemsDone([ItemResult("started", 0, 1, FINISHED, 0.1)]), 0.1)  # half done
    core.held = True
    core.add(make_request(request_id="waits"), [], 0.2)
    assert core.dispatch(0.3) == [] and core.time_until_dispatch(0.3) is None
    (failed,) = core.fail_started(503, TWO_VERSIONS, "weights_updated")
    assert failed.failed.request_id == "started" and failed.failed.code == "weights_updated"
    assert not core.busy and core.is_live("waits")
    core.held, core.weight_version = False, "3"
    (d,) = core.dispatch(0.4)
    (done,) = core.complete(0, ItemsDone([ItemResult("waits", 0, 1, FINISHED, 0.1)]), 0.5)
    assert done.done.weight_version == "3"
    core.refusing = "asleep"
    refused = core.add(make_request(request_id="late"), [], 0.6)
    assert refused.failed.status == 503 and refused.failed.code == "sleeping"
