"""Request state in the scheduler, in place: no processes, no sockets, a fake clock."""

import pytest

from diffserve.wire.protocol import (CANCELLED, FINISHED, REQUEST_MODE, STEP_MODE, FramesMismatch,
                               ItemResult, ItemsDone, Kind, decode, encode)
from diffserve.scheduler.core import DELAY, DRAIN, EXECUTOR_FREE, FULL, SchedulerCore
from helpers import make_request, ready_core as core, run, taken


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
    """Its frames are checked once, when its message is decoded; the core answers with a 400
    (and leaves a queued request of the same id alone)."""
    c = core()
    request = make_request(request_id="e", task="image-to-image")
    with pytest.raises(FramesMismatch) as caught:
        decode(encode(Kind.SUBMIT, request))
    assert caught.value.message == request and "declares 1 input frames" in str(caught.value)
    refused = c.refuse_malformed(caught.value.message, str(caught.value))
    assert refused.failed.status == 400 and "e" not in c.requests
    assert refused.failed.code == "invalid_value"
    c.add(make_request(request_id="q"), [], 0.0)
    assert c.refuse_malformed(make_request(request_id="q"), "no") is None and "q" in c.requests


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
    from diffserve.scheduler.service import split_wait

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
