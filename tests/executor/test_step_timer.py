"""A step's time as the device spent it: on the CPU the clock around the work; on CUDA (a
stand-in here, no GPU in CI) events around each span, one wait for the device at the end of the
step, and the events read only after it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from diffserve.executor.step.timer import StepTimer


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_on_the_cpu_spans_are_the_clock_around_them():
    clock = FakeClock()
    timer = StepTimer(torch, "cpu", clock)
    with timer.span():
        clock.now += 0.25
    clock.now += 1.0  # host work
    with timer.span():
        clock.now += 0.5
    assert timer.done() == 1.75 and timer.take_inner() == 0.75
    assert timer.take_inner() == 0.0  # taken


def test_on_cuda_the_events_are_read_after_one_wait_at_the_end_of_the_step():
    log = []

    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            log.append("record")
            self.at = len(log)

        def elapsed_time(self, end):
            assert log[-1] == "synchronize", "an event read before the device finished"
            return 100.0 * (end.at - self.at)  # milliseconds

    cuda = SimpleNamespace(Event=Event, synchronize=lambda device: log.append("synchronize"))
    fake = SimpleNamespace(cuda=cuda, device=torch.device)
    clock = FakeClock()
    timer = StepTimer(fake, "cuda:1", clock)
    with timer.span():
        log.append("forward queued")
    with timer.span():
        log.append("decode queued")
    clock.now = 3.0
    assert timer.done() == 3.0 and log.count("synchronize") == 1
    assert timer.take_inner() == 0.4  # two spans of two log entries each, 100 ms apart
