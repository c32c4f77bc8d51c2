"""The batcher's rules, driven with a fake clock."""

import pytest

from diffserve.wire.protocol import REQUEST_MODE, STEP_MODE
from diffserve.scheduler.batcher import Batcher
from helpers import make_request


def ids(batch):
    return [(s.request.request_id, s.start, s.stop) for s in batch]


def test_full_batch_goes_at_once():
    b = Batcher(max_batch_size=4, max_delay_s=10.0)
    for i in range(4):
        b.add(make_request(request_id=f"a{i}"), now=0.0)
    assert b.time_until_ready(0.0) == 0.0
    assert ids(b.next_batch(0.0)) == [(f"a{i}", 0, 1) for i in range(4)]
    assert len(b) == 0 and b.next_batch(0.0) is None


def test_partial_batch_waits_for_the_delay_from_the_oldest_request():
    b = Batcher(max_batch_size=8, max_delay_s=0.010)
    b.add(make_request(request_id="old"), now=1.000)
    b.add(make_request(request_id="new"), now=1.008)
    assert b.next_batch(1.008) is None
    assert b.time_until_ready(1.008) == pytest.approx(0.002)
    assert b.next_batch(1.0099) is None
    assert ids(b.next_batch(1.010)) == [("old", 0, 1), ("new", 0, 1)]


def test_zero_delay_dispatches_immediately():
    b = Batcher(max_batch_size=8, max_delay_s=0.0)
    b.add(make_request(request_id="x"), now=5.0)
    assert b.time_until_ready(5.0) == 0.0
    assert ids(b.next_batch(5.0)) == [("x", 0, 1)]


def test_force_takes_a_partial_batch_before_the_delay():
    b = Batcher(max_batch_size=8, max_delay_s=100.0)
    b.add(make_request(request_id="x"), now=0.0)
    assert b.next_batch(0.0) is None
    assert ids(b.next_batch(0.0, force=True)) == [("x", 0, 1)]


def test_max_size_bounds_the_batch_and_the_rest_stays_in_order():
    b = Batcher(max_batch_size=3, max_delay_s=0.0)
    for i in range(7):
        b.add(make_request(request_id=f"r{i}"), now=float(i) / 1000)
    sizes = []
    order = []
    while (batch := b.next_batch(1.0)) is not None:
        sizes.append(sum(s.size for s in batch))
        order += [s.request.request_id for s in batch]
    assert sizes == [3, 3, 1]
    assert order == [f"r{i}" for i in range(7)]


def test_batch_key_grouping_and_non_contiguous_selection():
    b = Batcher(max_batch_size=4, max_delay_s=0.0)
    b.add(make_request(request_id="a1", width=64), now=0.0)
    b.add(make_request(request_id="b1", width=128), now=0.1)
    b.add(make_request(request_id="a2", width=64), now=0.2)
    b.add(make_request(request_id="b2", width=128), now=0.3)
    b.add(make_request(request_id="a3", width=64, steps=8), now=0.4)  # different steps
    assert ids(b.next_batch(1.0)) == [("a1", 0, 1), ("a2", 0, 1)]
    assert ids(b.next_batch(1.0)) == [("b1", 0, 1), ("b2", 0, 1)]
    assert ids(b.next_batch(1.0)) == [("a3", 0, 1)]


def test_per_sample_fields_do_not_split_batches():
    b = Batcher(max_batch_size=8, max_delay_s=0.0)
    b.add(make_request(request_id="x", prompt="a cat", seed=1, negative_prompt="blur"), now=0.0)
    b.add(make_request(request_id="y", prompt="a dog", seed=99, n=3), now=0.0)
    assert ids(b.next_batch(0.0)) == [("x", 0, 1), ("y", 0, 3)]


def test_head_is_always_in_the_next_batch_even_if_another_group_is_full():
    b = Batcher(max_batch_size=2, max_delay_s=1.0)
    b.add(make_request(request_id="head", width=128), now=0.0)
    b.add(make_request(request_id="x1"), now=0.1)
    b.add(make_request(request_id="x2"), now=0.2)
    # The 64px group is full but the head's group is not and its delay has not passed.
    assert b.next_batch(0.5) is None
    assert ids(b.next_batch(1.0)) == [("head", 0, 1)]
    assert ids(b.next_batch(1.0)) == [("x1", 0, 1), ("x2", 0, 1)]


def test_head_never_starves_under_a_stream_of_compatible_later_requests():
    b = Batcher(max_batch_size=2, max_delay_s=0.0)
    b.add(make_request(request_id="lonely", width=256), now=0.0)
    t = 0.0
    for i in range(10):
        b.add(make_request(request_id=f"s{i}"), now=t)
        t += 0.001
    first = b.next_batch(t)
    assert [s.request.request_id for s in first] == ["lonely"]


def test_n_counts_images_toward_the_max_size():
    b = Batcher(max_batch_size=4, max_delay_s=10.0)
    b.add(make_request(request_id="big", n=3), now=0.0)
    assert b.next_batch(0.0) is None  # 3 of 4: not full
    b.add(make_request(request_id="two", n=2), now=0.0)
    # Full now: "two" is split, one image now and one in the next batch.
    assert ids(b.next_batch(0.0)) == [("big", 0, 3), ("two", 0, 1)]
    assert b.waiting_image_count == 1
    assert ids(b.next_batch(10.0)) == [("two", 1, 2)]


def test_request_larger_than_the_max_is_split_over_consecutive_calls():
    b = Batcher(max_batch_size=4, max_delay_s=0.0)
    b.add(make_request(request_id="huge", n=10), now=0.0)
    b.add(make_request(request_id="after"), now=0.1)
    assert ids(b.next_batch(1.0)) == [("huge", 0, 4)]
    assert ids(b.next_batch(1.0)) == [("huge", 4, 8)]
    assert ids(b.next_batch(1.0)) == [("huge", 8, 10), ("after", 0, 1)]


def test_split_remainder_keeps_its_original_enqueue_time():
    b = Batcher(max_batch_size=2, max_delay_s=5.0)
    b.add(make_request(request_id="r", n=3), now=0.0)
    assert ids(b.next_batch(0.0)) == [("r", 0, 2)]  # full
    assert b.time_until_ready(1.0) == pytest.approx(4.0)
    assert ids(b.next_batch(5.0)) == [("r", 2, 3)]


def test_abort_removes_waiting_images_and_updates_fullness():
    b = Batcher(max_batch_size=2, max_delay_s=10.0)
    b.add(make_request(request_id="a"), now=0.0)
    b.add(make_request(request_id="b"), now=0.0)
    assert b.abort("a") is True
    assert b.abort("a") is False
    assert "a" not in b and len(b) == 1
    assert b.next_batch(0.0) is None  # no longer full
    assert ids(b.next_batch(10.0)) == [("b", 0, 1)]
    assert b.time_until_ready(10.0) is None


def test_abort_of_a_partly_dispatched_request_drops_its_rest():
    b = Batcher(max_batch_size=2, max_delay_s=0.0)
    b.add(make_request(request_id="r", n=5), now=0.0)
    b.next_batch(0.0)
    assert b.waiting_image_count == 3
    assert b.abort("r")
    assert b.waiting_image_count == 0 and b.next_batch(1.0) is None


def test_drain_of_many_messages_forms_full_batches_in_order():
    b = Batcher(max_batch_size=8, max_delay_s=0.008)
    for i in range(100):  # a burst drained in one poll
        b.add(make_request(request_id=f"m{i}", width=64 if i % 3 else 128), now=0.0)
    batches = []
    while (batch := b.next_batch(0.0)) is not None:
        batches.append(batch)
    # Without waiting, only full batches go; leftovers wait for the delay.
    assert all(sum(s.size for s in batch) == 8 for batch in batches)
    rest = []
    while (batch := b.next_batch(1.0)) is not None:
        rest.append(batch)
    taken = [s.request.request_id for batch in batches + rest for s in batch]
    assert sorted(taken) == sorted(f"m{i}" for i in range(100))
    assert len(b) == 0


def test_duplicate_and_invalid_requests_are_refused():
    b = Batcher(max_batch_size=2, max_delay_s=0.0)
    b.add(make_request(request_id="x"), now=0.0)
    with pytest.raises(ValueError):
        b.add(make_request(request_id="x"), now=0.0)
    with pytest.raises(ValueError):
        b.add(make_request(request_id="y", n=0), now=0.0)
    with pytest.raises(ValueError):
        Batcher(max_batch_size=0, max_delay_s=0.0)


def test_step_mode_groups_requests_that_differ_in_steps_guidance_and_task():
    b = Batcher(max_batch_size=8, max_delay_s=0.0, mode=STEP_MODE)
    b.add(make_request(request_id="a", steps=4, guidance=5.0), now=0.0)
    b.add(make_request(request_id="b", steps=30, guidance=1.0, negative_prompt="x"), now=0.0)
    b.add(make_request(request_id="c", task="image-to-image", strength=0.5), now=0.0)
    b.add(make_request(request_id="d", width=128), now=0.0)  # another shape: never together
    assert ids(b.next_batch(0.0)) == [("a", 0, 1), ("b", 0, 1), ("c", 0, 1)]
    assert ids(b.next_batch(0.0)) == [("d", 0, 1)]


def test_request_mode_keeps_calls_with_one_schedule():
    b = Batcher(max_batch_size=8, max_delay_s=0.0, mode=REQUEST_MODE)
    b.add(make_request(request_id="a", steps=4), now=0.0)
    b.add(make_request(request_id="b", steps=30), now=0.0)
    assert ids(b.next_batch(0.0)) == [("a", 0, 1)]


def test_take_joins_the_head_group_only_and_never_passes_the_head():
    b = Batcher(max_batch_size=8, max_delay_s=10.0, mode=STEP_MODE)
    running = make_request(request_id="x").batch_key(STEP_MODE)
    b.add(make_request(request_id="big", width=128), now=0.0)
    b.add(make_request(request_id="fits", n=3), now=0.1)
    assert b.take(running, room=4) is None  # the head has another shape: nothing joins
    b.abort("big")
    # No delay for company of a running set; room bounds it and splits a request.
    assert ids(b.take(running, room=2)) == [("fits", 0, 2)]
    assert ids(b.take(running, room=5)) == [("fits", 2, 3)]
    assert b.take(running, room=5) is None


def test_room_bounds_a_new_group_and_decides_fullness():
    b = Batcher(max_batch_size=8, max_delay_s=10.0)
    b.add(make_request(request_id="r", n=3), now=0.0)
    assert b.is_full(room=3) and not b.is_full()
    assert ids(b.next_batch(0.0, room=2)) == [("r", 0, 2)]
