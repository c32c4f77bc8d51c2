"""Work beside the step loop: the encode stage (prompts, input images, a request's first latents)
and the decode stage (finished images, previews), so that the denoiser never waits for a text
encoder or a VAE.

A :class:`Stage` runs jobs in order on a thread of its own. A job whose ``run()`` returns a
generator runs in parts: after each part the jobs behind it get their turn (a long video's decode
does not hold up a short one's finish). On CUDA the thread has its own
stream: the stage's kernels run beside the step loop's, and what one side hands the other is
ordered by events (the consumer's stream waits for the producer's event; each tensor is recorded
on the stream that uses it, so the allocator does not reuse its memory early). On a CPU the same
thread runs with one intra-op thread of its own (OpenMP's team size is per calling thread), so
the loop keeps its own; docs/batching.md has what each choice measured. A stage can also run
inline (``threaded=False``): a job runs at once on the caller's thread, which is what a group's
ranks need (every rank must admit at the same step) and what ``--stages off`` asks for.

A stage shares no mutable per-call state with the loop: the per-row adapters keep one plan per
thread, ``inference_mode`` is entered on the stage's thread, and a pipeline helper that swaps the
pipeline's scheduler does it under a lock the request-mode calls also take.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from diffserve.device import of
from diffserve.executor.tensors import tensors_in

log = logging.getLogger(__name__)

QUEUE_BOUND = 64  # jobs a stage holds waiting or running; past it the loop waits for room


@dataclass(eq=False)
class StageJob:
    """Work for a stage: ``run()``'s result (or the exception it raised) is handed back."""

    request_ids: set[str]
    run: Callable[[], Any]
    result: Any = None
    error: BaseException | None = None
    ready: Any = None  # CUDA: an event the job's inputs are done at (on the loop's stream)
    done: Any = None  # CUDA: an event its results are done at (on the stage's stream)
    cancelled: bool = False
    started: bool = False
    meta: dict = field(default_factory=dict)
    parts: Any = None  # a job in parts: the generator run() returned, between two of its parts


class Stage:
    def __init__(self, name: str, torch, device, threaded: bool, notify: Callable[[], None],
                 bound: int = QUEUE_BOUND) -> None:
        """``notify()`` is called (from the stage's thread) each time a job is done."""
        self.name, self.torch = name, torch
        self.kind = of(device)
        self.queued = self.kind.queued  # CUDA: a stream of its own, handed over by events
        self.threaded, self.bound, self.notify = threaded, bound, notify
        self.busy_s = 0.0  # time running jobs, since the last take_times()
        self.stall_s = 0.0  # time the loop ran jobs inline or waited for this stage, likewise
        self._jobs: deque[StageJob] = deque()
        self._done: deque[StageJob] = deque()
        self._lock = threading.Condition()
        self._closing = False
        self._running: StageJob | None = None
        self._thread: threading.Thread | None = None
        self.stream = self.kind.stream(device) if self.queued and threaded else None

    @property
    def depth(self) -> int:
        """Jobs waiting or running here, or done and not taken yet."""
        with self._lock:
            return len(self._jobs) + len(self._done) + (1 if self._running is not None else 0)

    def jobs_held(self) -> list[StageJob]:
        """Every job not taken back yet: waiting, running, done."""
        with self._lock:
            running = [self._running] if self._running is not None else []
            return [*self._jobs, *running, *self._done]

    def submit(self, job: StageJob) -> None:
        """Queue ``job``; inline, run it now. A full stage makes the caller wait for room (the
        wait counts as stall): jobs always come back in the order they were submitted."""
        if not self.threaded:
            self._run(job)
            with self._lock:
                self._done.append(job)
            return
        if self.queued:  # the job starts once what the loop queued before it is done
            job.ready = self.kind.event()
            job.ready.record()
        with self._lock:
            if self._pending() >= self.bound:
                began = time.perf_counter()
                self._lock.wait_for(lambda: self._pending() < self.bound)
                self.stall_s += time.perf_counter() - began
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=f"stage-{self.name}",
                                                daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def _pending(self) -> int:
        return len(self._jobs) + (1 if self._running is not None else 0)

    def take(self) -> list[StageJob]:
        """The jobs done since the last call, in order; on CUDA the loop's stream then waits for
        each one's results."""
        with self._lock:
            done, self._done = list(self._done), deque()
        if self.queued:
            current = self.kind.current_stream()
            for job in done:
                if job.done is not None:
                    current.wait_event(job.done)
                    used_on(job.result, current)
        return done

    def cancel(self, request_ids: set[str]) -> None:
        """Jobs for these requests only: not started, they never run; running, their result is
        dropped by whoever takes it."""
        with self._lock:
            for job in self._jobs:
                if job.request_ids <= request_ids:
                    job.cancelled = True

    def add_stall(self, seconds: float) -> None:
        """The loop waited ``seconds`` for this stage (outside :meth:`submit`)."""
        with self._lock:
            self.stall_s += seconds

    def take_times(self) -> tuple[float, float]:
        """(busy, stall) seconds since the last call."""
        with self._lock:
            times, self.busy_s, self.stall_s = (self.busy_s, self.stall_s), 0.0, 0.0
        return times

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(5)

    def _work(self) -> None:
        torch = self.torch
        if not self.queued:
            torch.set_num_threads(1)  # this thread's OpenMP team only; the loop keeps its own
        while True:
            with self._lock:
                while not self._jobs and not self._closing:
                    self._lock.wait()
                if self._closing:
                    return
                job = self._jobs.popleft()
                self._running = job
            if self.queued and job.ready is not None:
                self.stream.wait_event(job.ready)
                job.ready = None
            more = self._run(job)
            if self.queued and not more:
                job.done = self.kind.event()
                job.done.record(self.stream)
            with self._lock:
                self._running = None
                if more:  # the other jobs' turn first
                    self._jobs.append(job)
                else:
                    self._done.append(job)
                    self._lock.notify_all()  # a caller waiting for room
            if not more:
                self.notify()

    def _run(self, job: StageJob) -> bool:
        """Run ``job`` (inline: to its end); True where it is a job in parts (its ``run()``
        returned a generator) with parts left."""
        if job.cancelled:
            return False
        torch, began = self.torch, time.perf_counter()
        inline = threading.current_thread() is not self._thread
        job.started, more = True, False
        try:
            with torch.inference_mode(), self.kind.on_stream(self.stream):
                if job.parts is None:
                    value = job.run()
                    if not inspect.isgenerator(value):
                        job.result = value
                        return False
                    job.parts = value
                next(job.parts)
                more = True
                while inline and more:
                    next(job.parts)
        except StopIteration as end:
            job.result, more = end.value, False
        except Exception as error:  # noqa: BLE001 - handed back: the job's requests fail
            job.error, more = error, False
        finally:
            with self._lock:
                elapsed = time.perf_counter() - began
                self.busy_s += elapsed
                if inline:  # the step loop did it
                    self.stall_s += elapsed
        return more


def used_on(value, stream) -> None:
    """Every CUDA tensor in ``value`` recorded as used on ``stream`` (lists, tuples, dicts,
    dataclasses and objects' attributes looked into)."""
    for tensor in tensors_in(value, objects=True):
        if tensor.is_cuda:
            tensor.record_stream(stream)


class Wakeup:
    """A file descriptor that becomes readable when a stage finishes a job: the step loop waits
    on it beside its socket when all it has left is stage work."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)

    def set(self) -> None:
        try:
            os.write(self._write_fd, b"\0")
        except BlockingIOError:  # already readable
            pass

    def clear(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass
