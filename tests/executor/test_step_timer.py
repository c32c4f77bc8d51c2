"""A step's time as the device spent it: on the CPU the clock around the work, known at once; on
CUDA (the device layer's fake GPU here, no GPU in CI) events around the lap and each span, read
only once a later lap is queued, so that the host never waits for the device between two
steps."""

from __future__ import annotations

import torch

from diffserve.device import installed
from diffserve.device.fake import FakeCuda
from diffserve.executor.step.timer import StepTimer


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_on_the_cpu_a_laps_time_is_the_clock_around_it_known_at_once():
    clock, laps = FakeClock(), []
    timer = StepTimer(torch, "cpu", clock)
    with timer.span():  # outside a lap: counts nowhere
        clock.now += 5.0
    timer.begin(lambda seconds, inner: laps.append((seconds, inner)))
    with timer.span():
        clock.now += 0.25
    clock.now += 1.0  # host work
    with timer.span():
        clock.now += 0.5
    timer.end(keep=1)
    assert laps == [(1.75, 0.75)]


class QueuedCard(FakeCuda):
    """The device layer's fake GPU, with events that know whether the device has reached them:
    ``finished`` counts the events the device has passed; reading one it has not passed without
    waiting is an error."""

    def __init__(self) -> None:
        super().__init__(count=2)
        self.log, self.recorded, self.finished = [], 0, 0
        card = self

        class Event:
            def __init__(self):
                self.at = None

            def record(self, stream=None):
                card.recorded += 1
                self.at = card.recorded

            def synchronize(self):
                card.log.append(f"wait for event {self.at}")
                card.finished = max(card.finished, self.at)

            def elapsed_time(self, end):
                assert end.at <= card.finished, "an event read before the device reached it"
                return 100.0 * (end.at - self.at)  # milliseconds

        self.Event = Event

    def event(self, timing: bool = False):
        assert timing
        return self.Event()

    def synchronize(self, device=None):
        raise AssertionError("a lap never waits for the whole device")


def test_on_cuda_a_lap_is_read_a_lap_later_without_waiting_for_the_device():
    fake = QueuedCard()
    with installed(fake):
        timer = StepTimer(torch, "cuda:1", FakeClock())
    laps = []
    for step in range(3):
        timer.begin(lambda seconds, inner, step=step: laps.append((step, seconds, inner)))
        with timer.span():  # the forward
            pass
        with timer.span():  # a decode
            pass
        timer.end(keep=1)
        # Step k's time is known once step k+1 is queued; the newest stays unread.
        assert [lap[0] for lap in laps] == list(range(step))
    timer.collect(keep=0)  # nothing more to queue: read the last
    assert [lap[0] for lap in laps] == [0, 1, 2]
    # Each lap: start, two spans of two events, end: 5 events 100 ms apart; spans 0.1 s each.
    assert all(abs(seconds - 0.5) < 1e-9 and abs(inner - 0.2) < 1e-9 for _, seconds, inner in laps)
    assert fake.log == ["wait for event 6", "wait for event 12", "wait for event 18"]
