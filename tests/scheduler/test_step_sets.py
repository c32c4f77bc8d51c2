"""Step-mode running sets and several executors in the scheduler, in place: no processes, no
sockets, a fake clock."""

from diffserve.wire.protocol import REQUEST_MODE, STEP_MODE, batch_key_fields
from diffserve.scheduler.slots import Pricing
from diffserve.wire.costs import RowCost
from diffserve.wire.request import ImageRequest
from diffserve.scheduler.core import DELAY, FULL, JOIN, NEW_SET
from helpers import make_request, ready_core as core, run, taken


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
    fields = batch_key_fields(ImageRequest, STEP_MODE)
    size = lambda key: (key[fields.index("width")], key[fields.index("height")])  # noqa: E731
    assert {size(key): rs.samples for key, rs in c.slots[0].sets.items()} == {(64, 64): 3,
                                                                             (128, 64): 2}


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
    from diffserve.wire.costs import default_bounds, image_cost, uses_cfg
    from diffserve.executor.families.known import family_named

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


def test_where_the_engine_mixes_sizes_they_share_one_set_priced_with_its_padding():
    c = core(max_size=8, delay=0.0, mode=STEP_MODE)
    c.set_mode(STEP_MODE, 8.0, 12.0, None, frozenset({"generate", "image-to-image"}))
    c.add(make_request(request_id="small", n=2, cost=1.0), [], 0.0)
    (first,) = c.dispatch(0.0)
    c.add(make_request(request_id="large", width=96, height=96, cost=2.25), [], 0.1)
    c.add(make_request(request_id="edit", task="image-to-image", width=96, cost=2.25), [], 0.2)
    (joined,) = c.dispatch(0.2)
    # Every size joins the one running set, as far as the padding leaves room: with "large",
    # the two small rows cost 2 x 1 x (96*96 / 64*64) = 4.5, so the set costs 6.75 of the 8;
    # the 96x64 edit would cost 1.5 x 2.25 more.
    assert joined.reason == JOIN and taken([joined]) == [[("large", 0, 1)]]
    (running,) = c.slots[0].sets.values()
    assert (running.samples, running.cost) == (3, 2 * 9216 / 4096 + 2.25)
    run(c, first, now=0.3)
    (edit,) = c.dispatch(0.3)  # the small rows gone, it fits: 2.25 + 2.25 x 1.5
    assert taken([edit]) == [[("edit", 0, 1)]] and c.slots[0].cost == 2.25 + 2.25 * 1.5


def test_where_sizes_share_one_grid_the_padding_is_the_tallest_by_the_widest():
    c = core(max_size=8, delay=0.0, mode=STEP_MODE)
    c.set_mode(STEP_MODE, 8.0, 12.0, None, frozenset({"generate"}), Pricing(grid=True))
    c.add(make_request(request_id="wide", width=128, height=64, cost=2.0), [], 0.0)
    c.add(make_request(request_id="tall", width=64, height=128, cost=2.0), [], 0.0)
    (both,) = c.dispatch(0.0)
    assert taken([both]) == [[("wide", 0, 1), ("tall", 0, 1)]]
    # Both rows padded to a 128x128 grid: 2 x 2.0 x (128*128 / 128*64).
    assert c.slots[0].cost == 8.0
    c.add(make_request(request_id="small", cost=1.0), [], 0.1)
    assert c.dispatch(0.1) == []  # a third row would take the forward past its 8.0


def test_a_sets_padding_is_priced_by_the_models_row_cost():
    """Where the model's FLOPs were fitted, a row's cost grows with attention's square: a set's
    rows are priced at the padded size by that curve, not by the tokens alone."""
    row = RowCost(0.2, 0.6, 0.2)  # a native row: 1.0; twice its pixels: 0.2 + 1.2 + 0.8 = 2.2
    c = core(max_size=8, delay=0.0, mode=STEP_MODE)
    c.set_mode(STEP_MODE, 6.0, 12.0, None, frozenset({"generate"}),
               Pricing(row=row, native=(64, 64, 0, 1)))
    c.add(make_request(request_id="native", n=2, cost=1.0), [], 0.0)
    c.add(make_request(request_id="wide", width=128, height=64, cost=2.2), [], 0.0)
    c.add(make_request(request_id="another", width=128, height=64, cost=2.2), [], 0.0)
    (first,) = c.dispatch(0.0)
    # Every row at the wide size: 3 x 2.2 = 6.6 would pass the 6.0; the native pair and one
    # wide row fill 6.6 too, so the wide ones wait: 2 native rows alone cost 2.0.
    assert taken([first]) == [[("native", 0, 2)]]
    assert c.slots[0].cost == 2.0
    (running,) = c.slots[0].sets.values()
    assert running.rows == 2.0
