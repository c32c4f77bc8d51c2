"""Request state in the scheduler, in place: no processes, no sockets, a fake clock."""

import pytest

from diffserve.protocol import CANCELLED, FINISHED, REQUEST_MODE, STEP_MODE, ItemResult, ItemsDone
from diffserve.scheduler.core import DELAY, DRAIN, EXECUTOR_FREE, FULL, JOIN, NEW_SET, SchedulerCore
from helpers import make_request, run, taken


def core(max_size=4, delay=0.0, executors=1, mode=REQUEST_MODE, **kw):
    c = SchedulerCore(max_size, delay, executors, mode=mode, **kw)
    for i in range(executors):
        c.executor_ready(i, 0.0)
    return c


def test_nothing_is_dispatched_until_an_executor_is_ready_and_idle():
    c = SchedulerCore(4, 0.0)
    c.add(make_request(request_id="a"), [], 0.0)
    assert c.dispatch(0.0) == [] and c.time_until_dispatch(0.0) is None
    c.executor_ready(0, 0.0)
    (d,) = c.dispatch(0.0)
    assert taken([d]) == [[("a", 0, 1)]] and d.executor == 0
    c.add(make_request(request_id="b"), [], 0.0)
    assert c.dispatch(0.0) == []  # request mode: one call in flight per executor
    assert c.num_running == 1 and c.num_waiting == 1
    run(c, d)
    assert len(c.dispatch(1.0)) == 1


def test_a_split_request_is_answered_once_with_all_images_in_order():
    c = core(max_size=2)
    c.add(make_request(request_id="big", n=5, seed=100), [], 0.0)
    answers = []
    while dispatched := c.dispatch(1.0):
        answers += run(c, dispatched[0])
    assert len(answers) == 1
    done = answers[0].done
    assert done.request_id == "big" and done.seeds == [100, 101, 102, 103, 104]
    assert answers[0].execution_s == pytest.approx(0.3)  # three calls of 0.1 s made its images
    assert done.prompt_tokens == 7
    assert not c.requests


def test_edit_input_frames_travel_with_every_item():
    c = core(max_size=2)
    image, mask = b"pixels", b"mask"
    c.add(make_request(request_id="e", n=3, task="inpaint"), [image, mask], 0.0)
    first, = c.dispatch(0.0)
    run(c, first)
    second, = c.dispatch(1.0)
    assert first.frames == second.frames == [image, mask]


def test_an_edit_without_its_frames_is_refused():
    c = core()
    refused = c.add(make_request(request_id="e", task="image-to-image"), [], 0.0)
    assert refused.failed.status == 400 and "e" not in c.requests


def test_error_of_one_request_fails_only_that_request():
    c = core()
    c.add(make_request(request_id="good"), [], 0.0)
    c.add(make_request(request_id="bad", n=2), [], 0.0)
    answers = run(c, c.dispatch(0.0)[0], errors={"bad": "boom"})
    by_id = {a.request_id: a for a in answers}
    assert by_id["bad"].failed.status == 500 and "boom" in by_id["bad"].failed.message
    assert by_id["good"].done is not None


def test_executor_loss_fails_what_it_held_and_keeps_the_queue():
    """A request with a part still waiting cannot simply run again: 503 with the reason."""
    c = core(max_size=2)
    c.add(make_request(request_id="split", n=3), [], 0.0)
    c.add(make_request(request_id="queued", width=128), [], 0.0)
    c.dispatch(0.0)  # split[0:2]
    answers = c.executor_lost(0, "executor died", 0.5)
    assert [(a.request_id, a.failed.status, a.failed.code) for a in answers] == [
        ("split", 503, "executor_restarted")]
    assert "split" not in c.batcher  # its remaining image is not run
    assert c.dispatch(0.5) == []  # no executor ready
    c.executor_ready(0, 1.0)
    assert taken(c.dispatch(1.0)) == [[("queued", 0, 1)]]


def test_late_result_of_a_written_off_item_is_ignored():
    c = core()
    c.add(make_request(request_id="a", partial_images=1), [], 0.0)  # previews: no retry
    (old,) = c.dispatch(0.0)
    c.executor_lost(0, "gone", 0.1)
    c.executor_ready(0, 0.2)
    c.add(make_request(request_id="b"), [], 0.2)
    (new,) = c.dispatch(0.2)
    assert run(c, old) == []
    assert c.num_running == 1  # still waiting for "b"
    assert [a.request_id for a in run(c, new)] == ["b"]


def test_a_request_whose_executor_died_runs_again_once_where_nothing_was_emitted():
    """Held whole by the lost executor, no image made, no preview or progress asked for: it
    runs again from its place in the queue, ahead of later arrivals; lost a second time, or
    one that streams, it is answered 503 with the reason."""
    c = core(max_size=4, executors=2, delay=0.0)
    c.add(make_request(request_id="plain"), [], 0.0)
    c.add(make_request(request_id="streams", partial_images=2, width=128), [], 0.0)
    first = c.dispatch(0.0)
    assert sorted(d.executor for d in first) == [0, 1]
    on = {d.work.items[0].request.request_id: d.executor for d in first}
    c.add(make_request(request_id="later", width=96), [], 0.5)
    answers = c.executor_lost(on["plain"], "executor died", 1.0)
    assert answers == [] and "plain" in c.batcher
    assert c.batcher.head_id() == "plain"  # at its place: before "later"
    answers = c.executor_lost(on["streams"], "executor died", 1.1)
    assert [(a.request_id, a.failed.status) for a in answers] == [("streams", 503)]
    c.executor_ready(0, 1.2)
    (again,) = [d for d in c.dispatch(1.2) if d.work.items[0].request.request_id == "plain"]
    assert [a.failed.status for a in c.executor_lost(again.executor, "died again", 1.3)] == [503]


def test_abort_while_running_discards_its_images_and_cancels_at_its_executor():
    c = core(executors=2, max_size=1)
    c.add(make_request(request_id="gone"), [], 0.0)
    c.add(make_request(request_id="stays"), [], 0.0)
    first, second = c.dispatch(0.0)
    assert c.abort(first.work.items[0].request.request_id)
    assert [(i, cancel.request_ids) for i, cancel in c.take_cancels()] == [(first.executor, ["gone"])]
    assert not c.abort("gone") and c.take_cancels() == []
    assert run(c, first, status=CANCELLED) == []
    assert [a.request_id for a in run(c, second)] == ["stays"]


@pytest.mark.parametrize("executors", [1, 2])
def test_when_one_part_of_a_split_request_fails_its_other_parts_are_cancelled(executors):
    c = core(max_size=2, executors=executors, mode=STEP_MODE if executors == 1 else REQUEST_MODE)
    c.add(make_request(request_id="big", n=6), [], 0.0)
    dispatched = c.dispatch(0.0)  # one part per executor; the rest waits
    assert c.take_cancels() == []
    answers = run(c, dispatched[0], errors={"big": "boom"})
    assert [(a.request_id, a.failed.status) for a in answers] == [("big", 500)]
    # Every other executor holding a part is told to drop it; nothing of it is queued any more.
    assert sorted(i for i, _ in c.take_cancels()) == [d.executor for d in dispatched[1:]]
    assert "big" not in c.batcher
    for d in dispatched[1:]:  # what they send back is dropped; their room is free again
        assert run(c, d, status=CANCELLED) == []
    assert all(slot.samples == 0 for slot in c.slots)


def test_when_the_executor_of_one_part_dies_the_other_parts_are_cancelled():
    c = core(max_size=2, executors=2)
    c.add(make_request(request_id="big", n=4), [], 0.0)
    on0, on1 = c.dispatch(0.0)
    answers = c.executor_lost(0, "executor 0 died", 0.1)
    assert [(a.request_id, a.failed.status) for a in answers] == [("big", 503)]
    assert [(i, cancel.request_ids) for i, cancel in c.take_cancels()] == [(1, ["big"])]


@pytest.mark.parametrize("wrong", ["stop", "start", "unknown request"])
def test_a_result_that_does_not_match_its_work_is_answered_500_never_stranded(wrong):
    c = core(max_size=4)
    c.add(make_request(request_id="a", n=2), [], 0.0)
    c.add(make_request(request_id="b"), [], 0.0)
    (d,) = c.dispatch(0.0)
    bad = {"stop": ItemResult("a", 0, 1, FINISHED, 0.1),
           "start": ItemResult("a", 1, 2, FINISHED, 0.1),
           "unknown request": ItemResult("zzz", 0, 1, FINISHED, 0.1)}[wrong]
    answers = c.complete(0, ItemsDone([bad, ItemResult("b", 0, 1, FINISHED, 0.1)]), 1.0)
    by_id = {a.request_id: a for a in answers}
    assert by_id["b"].done is not None  # the well-formed result of the same message counts
    if wrong != "unknown request":
        assert by_id["a"].failed.status == 500  # answered, not left without a slot or a queue entry
        assert not c.requests
    else:
        assert "a" in c.requests  # an answer for nobody touches no one else


def test_duplicate_request_id_is_refused_without_touching_the_first():
    c = core()
    assert c.add(make_request(request_id="x"), [], 0.0) is None
    refused = c.add(make_request(request_id="x"), [], 0.0)
    assert refused.failed.status == 409
    assert c.num_waiting == 1


def test_fail_all_answers_every_known_request_once():
    c = core(max_size=1)
    for rid in "abc":
        c.add(make_request(request_id=rid), [], 0.0)
    c.dispatch(0.0)
    answers = c.fail_all(503, "stopping")
    assert sorted(a.request_id for a in answers) == ["a", "b", "c"]
    assert c.fail_all(503, "again") == []


def test_queue_limit_refuses_with_429_and_counts_only_waiting_requests():
    c = core(max_size=1, max_queue_size=2)
    assert c.add(make_request(request_id="a"), [], 0.0) is None
    c.dispatch(0.0)  # a runs: not waiting any more
    assert c.add(make_request(request_id="b"), [], 0.0) is None
    assert c.add(make_request(request_id="c"), [], 0.0) is None
    refused = c.add(make_request(request_id="d"), [], 0.0)
    assert refused.failed.status == 429 and refused.failed.code == "overloaded"
    assert "d" not in c.requests and c.num_waiting == 2


def test_requests_that_wait_past_the_timeout_expire_unless_started():
    c = core(max_size=2, request_timeout_s=10.0)
    c.add(make_request(request_id="split", n=3), [], 0.0)
    c.dispatch(0.0)  # split has started; its last image still waits
    c.add(make_request(request_id="old", width=128), [], 1.0)
    c.add(make_request(request_id="young", width=128), [], 5.0)
    assert c.time_until_wakeup(2.0) == 9.0  # busy executor: only the expiry of "old" is due
    assert c.expire(10.5) == []
    expired = c.expire(11.0)
    assert [(f.request_id, f.failed.status, f.failed.code) for f in expired] == [("old", 503, "timeout")]
    assert "old" not in c.batcher and "split" in c.batcher and "young" in c.batcher
    assert [f.request_id for f in c.expire(15.0)] == ["young"]


def test_each_request_of_a_shared_call_is_charged_the_whole_call():
    c = core(max_size=4)
    c.add(make_request(request_id="a"), [], 0.0)
    c.add(make_request(request_id="b", n=2), [], 0.0)
    answers = run(c, c.dispatch(1.0)[0])
    assert sorted((f.request_id, f.execution_s) for f in answers) == [("a", 0.1), ("b", 0.1)]


def test_poll_wait_never_overshoots_a_deadline():
    from diffserve.scheduler.process import split_wait

    assert split_wait(None) == (0.0, None)  # nothing to wait for: block until an event
    assert split_wait(0.0) == (0.0, 0)
    assert split_wait(0.0004) == (0.0004, 0)  # under 1 ms: slept precisely, then a poll
    assert split_wait(0.0085) == (0.0, 8)  # whole ms by poll; the rest on the next turn
    assert split_wait(2.5) == (0.0, 2500)


# -- why a dispatch left ---------------------------------------------------------------------


def test_dispatch_reasons_full_delay_executor_free_and_drain():
    c = core(max_size=2, delay=0.010)
    c.add(make_request(request_id="a"), [], 0.0)
    c.add(make_request(request_id="b"), [], 0.0)
    (d,) = c.dispatch(0.0)
    assert d.reason == FULL
    c.add(make_request(request_id="c"), [], 0.001)
    assert c.dispatch(0.005) == [] and c.time_until_dispatch(0.005) is None  # executor busy
    run(c, d, now=0.050)  # frees up after c's delay ran out
    (late,) = c.dispatch(0.050)
    assert late.reason == EXECUTOR_FREE
    run(c, late, now=0.060)
    c.add(make_request(request_id="d"), [], 0.100)
    assert c.time_until_dispatch(0.100) == pytest.approx(0.010)
    (timed,) = c.dispatch(0.110)
    assert timed.reason == DELAY
    run(c, timed, now=0.120)
    c.add(make_request(request_id="e"), [], 0.200)
    c.start_drain()
    (drained,) = c.dispatch(0.200)
    assert drained.reason == DRAIN


# -- step mode -------------------------------------------------------------------------------


def test_step_mode_a_running_set_takes_compatible_company_at_once_up_to_its_room():
    c = core(max_size=4, delay=10.0, mode=STEP_MODE)
    c.add(make_request(request_id="a", n=4), [], 0.0)
    (first,) = c.dispatch(0.0)
    assert first.reason == FULL
    c.add(make_request(request_id="long", steps=50, guidance=1.0), [], 0.1)
    assert c.dispatch(0.1) == []  # no room
    run(c, first, now=0.2)
    assert c.dispatch(0.2) == []  # the set is empty again: a new one waits for company
    (new,) = c.dispatch(10.1)
    assert new.reason == DELAY and taken([new]) == [[("long", 0, 1)]]
    c.add(make_request(request_id="short", steps=2, n=2), [], 10.2)
    (company,) = c.dispatch(10.2)  # different steps and guidance share the set, no delay
    assert company.reason == JOIN and taken([company]) == [[("short", 0, 2)]]
    c.add(make_request(request_id="more", n=3), [], 10.3)
    (part,) = c.dispatch(10.3)
    assert taken([part]) == [[("more", 0, 1)]]  # room for one image; the rest waits


def test_step_mode_a_head_of_another_size_opens_a_set_of_its_own_at_once():
    c = core(max_size=8, delay=0.0, mode=STEP_MODE)
    c.add(make_request(request_id="running", n=2), [], 0.0)
    (first,) = c.dispatch(0.0)
    c.add(make_request(request_id="wide", width=128, n=2), [], 0.1)
    c.add(make_request(request_id="small-again"), [], 0.2)
    second, third = c.dispatch(0.3)  # no draining: the other size runs beside, at once
    assert (second.reason, taken([second])) == (NEW_SET, [[("wide", 0, 2)]])
    assert (third.reason, taken([third])) == (JOIN, [[("small-again", 0, 1)]])
    assert {sig[1:3]: rs.samples for sig, rs in c.slots[0].sets.items()} == {(64, 64): 3, (128, 64): 2}


def test_two_sizes_arriving_interleaved_are_both_running_after_one_dispatch():
    c = core(max_size=8, delay=0.0, mode=STEP_MODE)
    for i in range(6):
        c.add(make_request(request_id=f"r{i}", width=64 if i % 2 else 96), [], 0.01 * i)
    dispatched = c.dispatch(0.1)
    assert len(c.slots[0].sets) == 2 and c.num_waiting == 0
    assert [d.reason for d in dispatched][1:] == [NEW_SET] + [JOIN] * (len(dispatched) - 2)


def test_cost_bounds_one_forward_and_what_an_executor_holds_across_its_sets():
    # Costs as the frontend prices them: a 2x-size image is 4x, with guidance twice that.
    c = core(max_size=8, delay=0.0, mode=STEP_MODE, max_batch_cost=8.0, max_running_cost=12.0)
    c.add(make_request(request_id="big", width=128, height=128, n=3, cost=4.0), [], 0.0)
    (first,) = c.dispatch(0.0)
    assert taken([first]) == [[("big", 0, 2)]]  # 2 x 4 fills the forward's 8; one image waits
    c.add(make_request(request_id="small", n=6, cost=1.0), [], 0.1)
    assert c.dispatch(0.1) == []  # the head ("big"'s last image) has no room: nothing passes it
    assert c.waits_for_room == 1
    c.dispatch(0.15)
    assert c.waits_for_room == 1  # the same head waiting is counted once
    run(c, first, now=0.2)
    rest, small = c.dispatch(0.2)
    assert taken([rest]) == [[("big", 2, 3)]]
    assert taken([small]) == [[("small", 0, 6)]] and small.reason == NEW_SET  # 4 + 6 <= 12
    assert c.slots[0].cost == 10.0


def test_a_head_waiting_for_room_in_its_own_set_lets_other_sizes_fill_theirs_keeping_its_room():
    c = core(max_size=2, delay=0.0, mode=STEP_MODE, max_batch_cost=4.0, max_running_cost=7.0)
    c.add(make_request(request_id="big", width=128, n=2, cost=2.0), [], 0.0)
    (first,) = c.dispatch(0.0)
    c.add(make_request(request_id="head", width=128, cost=2.0), [], 0.1)  # its set is full
    c.add(make_request(request_id="small", n=3), [], 0.2)
    c.add(make_request(request_id="late-big", width=128, cost=2.0), [], 0.3)
    (beside,) = c.dispatch(0.3)
    # "small" starts a set of its own on the busy executor rather than wait behind the head, but
    # only as far as the running budget keeps room for the head's image: 7 - 4 - 2 = 1.
    assert (beside.reason, taken([beside])) == (NEW_SET, [[("small", 0, 1)]])
    assert c.slots[0].cost + 2.0 <= 7.0
    assert c.dispatch(0.35) == []  # nothing more fits beside the head; "late-big" never passes it
    run(c, first, now=0.4)
    head, rest = c.dispatch(0.4)  # the head goes the moment its set has room
    assert taken([head]) == [[("head", 0, 1), ("late-big", 0, 1)]] and head.reason == NEW_SET
    assert taken([rest]) == [[("small", 1, 2)]] and rest.reason == JOIN


def test_each_item_carries_how_long_its_request_waited_in_the_queue():
    c = core(max_size=2, delay=0.0, mode=STEP_MODE)
    c.add(make_request(request_id="split", n=3), [], 1.0)
    (first,) = c.dispatch(1.5)
    run(c, first, now=4.0)
    (rest,) = c.dispatch(4.0)
    assert [i.queued_s for i in first.work.items] == [0.5]
    assert [i.queued_s for i in rest.work.items] == [3.0]  # its second part waited longer


def test_step_mode_a_finished_part_frees_room_for_the_queue():
    c = core(max_size=2, mode=STEP_MODE)
    c.add(make_request(request_id="a"), [], 0.0)
    c.add(make_request(request_id="b", steps=50), [], 0.0)
    (d,) = c.dispatch(0.0)
    c.add(make_request(request_id="c"), [], 0.1)
    assert c.dispatch(0.1) == []
    answers = run(c, d, only={"a"})  # "a" retires, "b" keeps running
    assert [a.request_id for a in answers] == ["a"]
    (join,) = c.dispatch(0.2)
    assert join.reason == JOIN and taken([join]) == [[("c", 0, 1)]]


# -- several executors -----------------------------------------------------------------------


def test_one_queue_feeds_every_executor_and_the_least_loaded_gets_the_head():
    c = core(max_size=2, executors=3)
    for i in range(5):
        c.add(make_request(request_id=f"r{i}"), [], 0.0)
    dispatched = c.dispatch(0.0)
    assert [d.executor for d in dispatched] == [0, 1, 2]
    assert taken(dispatched) == [[("r0", 0, 1), ("r1", 0, 1)], [("r2", 0, 1), ("r3", 0, 1)],
                                 [("r4", 0, 1)]]


def test_step_mode_with_two_executors_a_new_shape_goes_to_the_idle_one():
    c = core(max_size=4, executors=2, mode=STEP_MODE)
    c.add(make_request(request_id="a"), [], 0.0)
    (first,) = c.dispatch(0.0)
    c.add(make_request(request_id="wide", width=128), [], 0.1)
    (second,) = c.dispatch(0.1)
    assert (first.executor, second.executor) == (0, 1)
    c.add(make_request(request_id="again"), [], 0.2)
    (join,) = c.dispatch(0.2)
    assert join.executor == 0 and join.reason == JOIN


def test_losing_one_executor_touches_only_its_requests():
    c = core(max_size=1, executors=2)
    c.add(make_request(request_id="on0", partial_images=1), [], 0.0)
    c.add(make_request(request_id="on1"), [], 0.0)
    d0, d1 = c.dispatch(0.0)
    answers = c.executor_lost(0, "executor 0 died", 0.1)
    assert [a.request_id for a in answers] == ["on0"]
    assert [a.request_id for a in run(c, d1)] == ["on1"]
    c.add(make_request(request_id="next"), [], 0.2)
    (d,) = c.dispatch(0.2)
    assert d.executor == 1  # executor 0 is not ready until it is back


def test_what_an_image_costs():
    from diffserve.costs import default_bounds, image_cost, uses_cfg
    from diffserve.executor.families import family_named

    sd, flux = (family_named(name).guidance_rule for name in ("stable-diffusion", "flux"))

    assert image_cost(128, 128, 64, 64, cfg=False) == 4.0  # twice the side: four times the cost
    assert image_cost(128, 128, 64, 64, cfg=True) == 8.0  # guidance doubles the rows
    assert image_cost(32, 64, 64, 64, cfg=True) == 1.0
    assert uses_cfg(sd, 5.0, "") and not uses_cfg(sd, 1.0, "x")
    assert not uses_cfg(flux, 5.0, "")  # guidance is an input of Flux's transformer
    assert default_bounds(8, 0, 0, native_image_cost=2.0) == (16.0, 32.0)  # 8 native CFG images
    assert default_bounds(8, 10.0, 12.0, native_image_cost=2.0) == (10.0, 12.0)


def test_a_task_in_request_mode_beside_the_step_engine_runs_as_calls_of_its_own():
    """Inpainting fell back to request mode at start-up, generation kept the step engine: an
    inpainting batch takes only requests with its steps and strength (request mode's key), goes
    to a busy executor as a call of its own, takes no company once sent, and the next batch of
    its key waits for it; generations keep joining their running set meanwhile."""
    c = core(max_size=4, mode=STEP_MODE)
    c.set_mode(STEP_MODE, task_modes={"generate": STEP_MODE, "inpaint": REQUEST_MODE})
    c.add(make_request(request_id="g1", steps=4), [], 0.0)
    (gen,) = c.dispatch(0.0)
    inpaint = lambda rid, steps: make_request(request_id=rid, task="inpaint", steps=steps,  # noqa: E731
                                              strength=0.5)
    for rid, steps in (("i1", 4), ("i2", 6), ("i3", 4)):
        c.add(inpaint(rid, steps), [None, None], 0.1)
    four, six = c.dispatch(0.2)
    assert taken([four, six]) == [[("i1", 0, 1), ("i3", 0, 1)], [("i2", 0, 1)]]
    assert four.reason == six.reason == NEW_SET
    c.add(inpaint("i4", 4), [None, None], 0.3)
    c.add(make_request(request_id="g2", steps=9), [], 0.3)
    (joined,) = c.dispatch(0.3)  # i4 waits for the call of its key; g2 passes beside it
    assert taken([joined]) == [[("g2", 0, 1)]] and joined.reason == JOIN
    assert c.num_waiting == 1
    run(c, four, now=0.5)
    (again,) = c.dispatch(0.5)
    assert taken([again]) == [[("i4", 0, 1)]]
