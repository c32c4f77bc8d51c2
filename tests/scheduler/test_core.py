"""Request state in the scheduler, in place: no processes, no sockets."""

import pytest

from diffserve.protocol import BatchResult, ImageMeta
from diffserve.scheduler.core import SchedulerCore
from helpers import make_request


def core(max_size=4, delay=0.0):
    c = SchedulerCore(max_size, delay)
    c.executor_ready = True
    return c


def run(c, d, errors=None, drop=()):
    """Answer dispatch ``d`` like an executor: one frame per sample, named after it."""
    errors = errors or {}
    metas, frames = [], []
    for s in d.batch.samples:
        if s.request_id in errors or (s.request_id, s.index) in drop:
            continue
        metas.append(ImageMeta(s.request_id, s.index, s.seed))
        frames.append(f"{s.request_id}:{s.index}:{s.seed}".encode())
    result = BatchResult(d.batch.batch_id, 64, 64, 0.1, metas, errors)
    return c.complete(result, frames)


def test_nothing_is_dispatched_until_the_executor_is_ready_and_idle():
    c = SchedulerCore(4, 0.0)
    c.add(make_request(request_id="a"), 0.0)
    assert c.dispatch(0.0) is None and c.time_until_dispatch(0.0) is None
    c.executor_ready = True
    d = c.dispatch(0.0)
    assert [s.request_id for s in d.batch.samples] == ["a"]
    c.add(make_request(request_id="b"), 0.0)
    assert c.dispatch(0.0) is None  # busy: one batch in flight
    assert c.num_running == 1 and c.num_waiting == 1
    run(c, d)
    assert c.dispatch(0.0) is not None


def test_samples_carry_per_image_seeds_and_the_shared_params():
    c = core()
    c.add(make_request(request_id="a", n=3, seed=10, prompt="cat", width=128), 0.0)
    d = c.dispatch(0.0)
    assert [(s.index, s.seed, s.prompt) for s in d.batch.samples] == [(0, 10, "cat"), (1, 11, "cat"), (2, 12, "cat")]
    assert d.batch.params["width"] == 128
    assert d.queue_times_s == [0.0]


def test_a_split_request_is_answered_once_with_all_images_in_order():
    c = core(max_size=2)
    c.add(make_request(request_id="big", n=5, seed=100), 0.0)
    answers = []
    while (d := c.dispatch(1.0)) is not None:
        answers += run(c, d)
    assert len(answers) == 1
    done = answers[0].done
    assert done.request_id == "big" and done.seeds == [100, 101, 102, 103, 104]
    assert answers[0].frames == [f"big:{i}:{100 + i}".encode() for i in range(5)]
    assert answers[0].execution_s == pytest.approx(0.3)  # three calls of 0.1 s made its images
    assert not c.requests


def test_error_of_one_request_fails_only_that_request():
    c = core()
    c.add(make_request(request_id="good"), 0.0)
    c.add(make_request(request_id="bad", n=2), 0.0)
    answers = run(c, c.dispatch(0.0), errors={"bad": "boom"})
    by_id = {a.request_id: a for a in answers}
    assert by_id["bad"].failed.status == 500 and "boom" in by_id["bad"].failed.message
    assert by_id["good"].done is not None


def test_executor_loss_fails_the_running_requests_and_keeps_the_queue():
    c = core(max_size=2)
    c.add(make_request(request_id="split", n=3), 0.0)
    c.add(make_request(request_id="queued", width=128), 0.0)
    c.dispatch(0.0)  # split[0:2]
    answers = c.executor_lost("executor died")
    assert [(a.request_id, a.failed.status) for a in answers] == [("split", 500)]
    assert "split" not in c.batcher  # its remaining image is not run
    assert c.dispatch(0.0) is None  # executor not ready
    c.executor_ready = True
    d = c.dispatch(0.0)
    assert [s.request_id for s in d.batch.samples] == ["queued"]


def test_late_result_of_a_written_off_batch_is_ignored():
    c = core()
    c.add(make_request(request_id="a"), 0.0)
    old = c.dispatch(0.0)
    c.executor_lost("gone")
    c.executor_ready = True
    c.add(make_request(request_id="b"), 0.0)
    new = c.dispatch(0.0)
    assert run(c, old) == []
    assert c.running is new.batch  # still waiting for the new batch
    assert [a.request_id for a in run(c, new)] == ["b"]


def test_abort_while_running_discards_its_images():
    c = core()
    c.add(make_request(request_id="gone"), 0.0)
    c.add(make_request(request_id="stays"), 0.0)
    d = c.dispatch(0.0)
    assert c.abort("gone") and not c.abort("gone")
    assert [a.request_id for a in run(c, d)] == ["stays"]


def test_malformed_result_fails_every_member():
    c = core()
    c.add(make_request(request_id="a"), 0.0)
    c.add(make_request(request_id="b"), 0.0)
    d = c.dispatch(0.0)
    answers = run(c, d, drop={("b", 0)})
    assert sorted(a.request_id for a in answers) == ["a", "b"]
    assert all(a.failed and a.failed.status == 500 for a in answers)


def test_duplicate_request_id_is_refused_without_touching_the_first():
    c = core()
    assert c.add(make_request(request_id="x"), 0.0) is None
    refused = c.add(make_request(request_id="x"), 0.0)
    assert refused.failed.status == 409
    assert c.num_waiting == 1


def test_fail_all_answers_every_known_request_once():
    c = core(max_size=1)
    for rid in "abc":
        c.add(make_request(request_id=rid), 0.0)
    c.dispatch(0.0)
    answers = c.fail_all(503, "stopping")
    assert sorted(a.request_id for a in answers) == ["a", "b", "c"]
    assert c.fail_all(503, "again") == []


def test_queue_limit_refuses_with_429_and_counts_only_waiting_requests():
    c = SchedulerCore(1, 0.0, max_queue_size=2)
    c.executor_ready = True
    assert c.add(make_request(request_id="a"), 0.0) is None
    c.dispatch(0.0)  # a runs: not waiting any more
    assert c.add(make_request(request_id="b"), 0.0) is None
    assert c.add(make_request(request_id="c"), 0.0) is None
    refused = c.add(make_request(request_id="d"), 0.0)
    assert refused.failed.status == 429 and refused.failed.code == "overloaded"
    assert "d" not in c.requests and c.num_waiting == 2


def test_requests_that_wait_past_the_timeout_expire_unless_started():
    c = SchedulerCore(2, 0.0, request_timeout_s=10.0)
    c.executor_ready = True
    c.add(make_request(request_id="split", n=3), 0.0)
    c.dispatch(0.0)  # split has started; its last image still waits
    c.add(make_request(request_id="old", width=128), 1.0)
    c.add(make_request(request_id="young", width=128), 5.0)
    assert c.time_until_wakeup(2.0) == 9.0  # busy executor: only the expiry of "old" is due
    assert c.expire(10.5) == []
    expired = c.expire(11.0)
    assert [(f.request_id, f.failed.status, f.failed.code) for f in expired] == [("old", 503, "timeout")]
    assert "old" not in c.batcher and "split" in c.batcher and "young" in c.batcher
    assert [f.request_id for f in c.expire(15.0)] == ["young"]


def test_abort_of_every_member_marks_the_running_batch_unwanted():
    c = core()
    c.add(make_request(request_id="a"), 0.0)
    c.add(make_request(request_id="b"), 0.0)
    c.dispatch(0.0)
    c.abort("a")
    assert not c.abort_leaves_batch_unwanted("a")
    c.abort("b")
    assert c.abort_leaves_batch_unwanted("b")


def test_poll_wait_never_overshoots_a_deadline():
    from diffserve.scheduler.process import split_wait

    assert split_wait(None) == (0.0, None)  # nothing to wait for: block until an event
    assert split_wait(0.0) == (0.0, 0)
    assert split_wait(0.0004) == (0.0004, 0)  # under 1 ms: slept precisely, then a poll
    assert split_wait(0.0085) == (0.0, 8)  # whole ms by poll; the rest on the next turn
    assert split_wait(2.5) == (0.0, 2500)


def test_each_request_of_a_shared_call_is_charged_the_whole_call():
    c = core(max_size=4)
    c.add(make_request(request_id="a"), 0.0)
    c.add(make_request(request_id="b", n=2), 0.0)
    answers = run(c, c.dispatch(1.0))
    assert sorted((f.request_id, f.execution_s) for f in answers) == [("a", 0.1), ("b", 0.1)]
