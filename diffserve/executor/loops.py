"""The executor's two loops around its engines, and the adapter commands both take between calls.

- **request mode** (:class:`RequestLoop`): one work message is one pipeline call. While it runs,
  the pipeline's step callback takes the cancels that have arrived, so a call whose callers have
  all gone stops at the next denoising step; any other message waits for the loop.
- **step mode** (:class:`StepLoop`): between two steps it takes every waiting message, admits
  the new work into the running set, drops cancelled requests, then runs one step. Every
  per-step decision is made here; nothing crosses a process boundary per step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from diffserve.executor.sockets import ExecutorSockets
from diffserve.executor.results import describe
from diffserve.wire.protocol import CANCELLED, LOAD, Kind
from diffserve.wire.request import Work
from diffserve.wire.samples import split_inputs

log = logging.getLogger(__name__)


def apply_adapter_message(adapters, io: ExecutorSockets, kind: Kind, msg) -> None:
    """A runtime load or unload (answered), or the server's whole adapter table (reconciled)."""
    from diffserve.executor.lora.store import AdapterError

    if kind is Kind.ADAPTER_SYNC:
        if adapters is not None:
            for error in adapters.sync(msg.adapters):
                log.error("could not catch up with a runtime adapter load: %s", error)
            io.count_resident(adapters)
        return
    if adapters is None:
        io.answer_adapter(msg.command_id, 400, "this server was started without LoRA adapters")
        return
    try:
        adapters.add(msg.name, msg.path) if msg.op == LOAD else adapters.remove(msg.name)
    except AdapterError as error:
        io.answer_adapter(msg.command_id, error.status, str(error))
    except Exception as error:  # noqa: BLE001 - the server keeps serving
        log.exception("adapter %s of %r failed", msg.op, msg.name)
        io.answer_adapter(msg.command_id, 500, f"{type(error).__name__}: {error}")
    else:
        io.answer_adapter(msg.command_id)
    io.count_resident(adapters)


ADAPTER_KINDS = (Kind.ADAPTER, Kind.ADAPTER_SYNC)


def apply_weight_step(weights, io: ExecutorSockets, step) -> None:
    """A step of a weight update or a sleep (diffserve.executor.rl.weights), answered."""
    from diffserve.executor.rl.weights import run_step

    io.answer_weights(run_step(weights, step))


class RequestLoop:
    """One work message at a time, one pipeline call each."""

    def __init__(self, make_runner, io: ExecutorSockets, adapters=None, nested: bool = False,
                 weights=None) -> None:
        """``make_runner(should_interrupt, emit_partial, emit_progress)`` builds the request
        runner. ``nested``: the calls of a step loop's request-mode tasks, whose cancels (which
        may concern its running sets too) also wait for that loop. ``weights``: what weight
        updates change (diffserve.executor.rl.weights), where they are on."""
        self.io = io
        self.adapters = adapters
        self.weights = weights
        self.runner = make_runner(self._should_interrupt, io.send_partial, io.send_progress)
        self.nested = nested
        self.running: set[str] = set()
        self.cancelled: set[str] = set()  # only ids of requests running or waiting here
        self.pending: deque[tuple[Kind, Any, list[Any]]] = deque()  # messages for the loop
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            message = self.pending.popleft() if self.pending else self.io.receive(block=True)
            if message is None:
                continue
            kind, msg, frames = message
            if kind is Kind.SHUTDOWN:
                self.stopping = True
            elif kind is Kind.CANCEL:
                self._cancel(msg.request_ids)
            elif kind is Kind.WORK:
                self.execute(msg, frames)
            elif kind in ADAPTER_KINDS:  # between calls: no call ever sees an adapter change
                apply_adapter_message(self.adapters, self.io, kind, msg)
            elif kind is Kind.WEIGHT_STEP:  # likewise: no call sees half-new weights
                apply_weight_step(self.weights, self.io, msg)
            else:
                log.warning("executor ignored a %s message", kind.name)

    def _cancel(self, request_ids: list[str]) -> None:
        """Remember cancels of requests that run or wait here; any other id is done already."""
        waiting = {item.request.request_id for kind, msg, _ in self.pending if kind is Kind.WORK
                   for item in msg.items}
        self.cancelled.update(set(request_ids) & (self.running | waiting))

    def execute(self, work: Work, frames: list[Any]) -> None:
        """One pipeline call over the work's items, answered."""
        self.running = {item.request.request_id for item in work.items}
        self.io.count_memory(sum(item.samples * item.request.cost for item in work.items))
        start = time.perf_counter()
        try:  # its frames were checked against its items' manifests when it was decoded
            outcomes = self.runner.execute(work, split_inputs(work.items, frames))
        finally:
            self.cancelled -= self.running  # a request id is never reused
            self.running = set()
            self.io.count_memory(0.0)
        self.io.count_call(time.perf_counter() - start,
                           bool(outcomes) and all(o.status == CANCELLED for o in outcomes))
        self.io.send_outcomes(outcomes)
        self.io.count_resident(self.adapters)

    def _should_interrupt(self) -> bool:
        """Asked at every denoising step: take the cancels that came meanwhile (anything else
        waits for the loop); stop once every caller of the call has gone."""
        while (message := self.io.receive(block=False)) is not None:
            if message[0] is Kind.CANCEL:
                self._cancel(message[1].request_ids)
                if not self.nested:
                    continue
            self.pending.append(message)
        return self.running <= self.cancelled


class StepLoop:
    """The running sets: admit and drop between steps, one step at a time. Work of the requests
    ``is_call`` names (their mode key runs in request mode: the start-up check sent it there)
    runs as one pipeline call of ``calls`` between two steps."""

    def __init__(self, engine, io: ExecutorSockets, adapters=None, calls: RequestLoop | None = None,
                 is_call=lambda request: False, link=None, weights=None) -> None:
        """``link``: a parallel group's control link (the engine is then its leader's), which
        adapter changes, weight steps and the shutdown also go through."""
        self.engine = engine
        self.io = io
        self.adapters = adapters
        self.weights = weights
        self.calls = calls
        self.is_call = is_call
        self.link = link
        self.stopping = False

    def _receive(self, block: bool):
        """The next message: first those that arrived during a request-mode call. Blocking with
        only stage work left, it also wakes when a stage finishes a job, and the wait counts as
        the stages' stall."""
        if self.calls is not None and self.calls.pending:
            return self.calls.pending.popleft()
        wake = self.engine.wakeup if block and self.engine.stage_pending else None
        if wake is None:
            return self.io.receive(block=block)
        began = time.perf_counter()
        message = self.io.receive(block=True, wake=wake.read_fd)
        self.engine.note_stall(time.perf_counter() - began)
        wake.clear()
        return message

    def run(self) -> None:
        while not self.stopping:
            work, cancels = [], []
            # An engine with nothing to step sleeps until work comes (or a stage finishes a job).
            message = self._receive(block=not self.engine.steppable)
            while message is not None:
                kind, msg, frames = message
                if kind is Kind.SHUTDOWN:
                    self.stopping = True
                elif kind is Kind.CANCEL:  # after the admissions: it may be for work just read
                    cancels += msg.request_ids
                elif kind is Kind.PAUSE:  # before the work it makes room for, which follows it
                    work = self._admit(work)
                    self.engine.pause(msg.items)
                elif kind is Kind.WORK:
                    work.append((msg, frames))
                elif kind in ADAPTER_KINDS:  # between steps, before the work that came after
                    work = self._admit(work)
                    if self.link is not None:
                        self.link.send("adapter", kind, msg)
                    apply_adapter_message(self.adapters, self.io, kind, msg)
                elif kind is Kind.WEIGHT_STEP:  # between two steps: no forward sees half of it
                    work = self._admit(work)
                    if self.link is not None:
                        self.link.send("weights", msg)
                    apply_weight_step(self.weights, self.io, msg)
                message = self._receive(block=False)
            if self.stopping:
                if self.link is not None:
                    self.link.close()
                self.engine.close()  # the stages' threads (the scheduler drained their work)
                break
            self._admit(work)
            if cancels:
                self.engine.cancel(cancels)
            if self.engine:
                try:
                    out = self.engine.step()
                except Exception as error:  # noqa: BLE001 - a bug in the engine itself
                    if self.link is not None:
                        # In a group the ranks may no longer agree: the group goes down, and the
                        # scheduler answers what it held and starts it again.
                        raise
                    # Every stage isolates its requests, so this is not a request's fault: what
                    # the engine held fails, and the executor (its model loaded) goes on serving.
                    log.exception("a step failed outside any request's stage")
                    self.io.send_outcomes(self.engine.abandon(describe(error)))
                    continue
                for partial in out.partials:
                    self.io.send_partial(partial)
                for progress in out.progress:
                    self.io.send_progress(*progress)
                self.io.send_outcomes(out.finished)
                self.io.count_step(out)
                if out.finished:
                    self.io.count_resident(self.adapters)

    def _admit(self, work: list[tuple[Work, list[Any]]]) -> list:
        """Admit the step engine's work and run the request-mode calls, in arrival order of
        each; returns the work still to do (none)."""
        if not work:
            return []
        calls, joins = [], []
        for msg, frames in work:  # a work message holds one batch key, so one task mode
            is_call = bool(msg.items) and self.is_call(msg.items[0].request)
            (calls if is_call else joins).append((msg, frames))
        self._join(joins)
        for msg, frames in calls:
            self.calls.execute(msg, frames)
        return []

    def _join(self, work: list[tuple[Work, list[Any]]]) -> None:
        if not work:
            return
        items, inputs = [], []
        for msg, frames in work:  # checked against the items' manifests when decoded
            inputs.extend(split_inputs(msg.items, frames))
            items.extend(msg.items)
        admitted = []  # the admission's device time is read with the next step's (deferred)
        self.engine.timer.begin(lambda seconds, inner: self.io.count_admission(seconds, *admitted))
        failed = self.engine.admit(items, inputs)
        admitted.append(len(items) - len(failed))
        self.engine.timer.end(keep=1 if self.engine else 0)
        self.io.send_outcomes(failed)
