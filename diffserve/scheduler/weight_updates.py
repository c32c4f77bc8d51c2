"""Weight updates and sleeping, over every executor: a pure object, like the scheduler core; the
process wrapper sends the steps it decides and does what its :class:`Actions` say.

An update runs in two phases over the executors that are ready when it begins. PREPARE: each
reads and checks the tensors, keeping them aside (the queue is held from here on: new requests
wait). If any executor refuses, the others DISCARD, and the answer is that refusal; nothing
changed. Otherwise, in ``abort`` mode every started request is answered at once; in ``drain``
mode the running work finishes first (on the old weights). Then COMMIT: each copies the tensors
into its weights between two steps, and once every one has, the version changes and the queue
moves again. A request that started before and is not done when the new weights apply (a paused
one, a part of a split request) is answered then, so that no request is made by two versions. A
commit that fails on one executor is undone on the others by a SYNC to the old state. An
executor that (re)starts is sent the current state (SYNC) before any work, and SLEEP if the
server sleeps.

Sleeping holds the queue, waits for the running work, and has every executor sleep; waking has
them wake and lets the queue go. An update while asleep is checked and committed as usual; an
executor at level 2 applies it as it wakes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffserve.wire.weight_commands import (
    ABORT_MODE,
    BASE_VERSION,
    COMMIT,
    DISCARD,
    PREPARE,
    SHARED,
    SLEEP,
    SYNC,
    UPDATE,
    WAKE,
    WeightCommand,
    WeightResult,
    WeightSource,
    WeightStep,
)

ABORTED = "The server's weights were updated (mode abort) while this request ran; send it again."
TWO_VERSIONS = ("The server's weights were updated before this request was done; a request is "
                "never made by two versions of the weights. Send it again.")


@dataclass
class Actions:
    """What the process does after a decision."""

    sends: list[tuple[int, WeightStep]] = field(default_factory=list)
    answer: WeightResult | None = None  # to the frontend: the command is over
    hold: bool | None = None  # hold (or let go) the queue
    fail_started: str | None = None  # answer every started request with this, first
    sync_others: set[int] | None = None  # ready executors outside these: send them the state
    delete: list[str] = field(default_factory=list)  # shared-memory files no longer needed
    changed: bool = False  # the version or the sleep state changed: publish the status


@dataclass
class _WeightCommandRunning:
    command: WeightCommand
    phase: str  # PREPARE, "drain", COMMIT, SLEEP, WAKE
    participants: list[int]
    version: str = ""
    waiting: set[int] = field(default_factory=set)
    succeeded: list[int] = field(default_factory=list)
    failure: WeightResult | None = None
    full: bool = True
    applied_at: float | None = None


class WeightControl:
    def __init__(self, reject_while_sleeping: bool = False) -> None:
        self.version = BASE_VERSION
        self.sources: list[WeightSource] = []
        self.sleeping = 0
        self.reject_while_sleeping = reject_while_sleeping
        self.running: _WeightCommandRunning | None = None

    @property
    def holds_queue(self) -> bool:
        return self.running is not None or self.sleeping > 0

    def next_version(self) -> str | None:
        """The current version plus one, where it is an integer."""
        return str(int(self.version) + 1) if self.version.isdigit() else None

    # -- a command begins ------------------------------------------------------------------

    def begin(self, command: WeightCommand, ready: list[int], busy: bool) -> Actions:
        refuse = lambda status, message, code: Actions(  # noqa: E731
            answer=WeightResult(command.command_id, status, message, code, self.version,
                                sleeping=self.sleeping),
            delete=[command.source.path] if command.source and command.source.kind == SHARED else [])
        if self.running is not None:
            return refuse(409, f"a {self.running.command.op} is under way; retry once it is done",
                          "busy")
        if command.op == WAKE and not self.sleeping or command.op == SLEEP and self.sleeping:
            return Actions(answer=WeightResult(command.command_id, version=self.version,
                                               sleeping=self.sleeping))
        if not ready:
            return refuse(503, "no executor is serving; retry shortly", "no_executor")
        version = ""
        if command.op == UPDATE:
            version = command.version or self.next_version() or ""
            if not version:
                return refuse(400, f"the current weight_version {self.version!r} is not an "
                              "integer: name the new one (weight_version)", "invalid_value")
        self.running = _WeightCommandRunning(command, command.op, list(ready), version)
        if command.op == UPDATE:
            return self._send(PREPARE, Actions(hold=True), sources=[command.source])
        if command.op == WAKE:
            return self._send(WAKE, Actions())
        self.running.phase = "drain"  # a sleep: what runs finishes first
        return self._drained(Actions(hold=True), busy)

    def _send(self, step: str, actions: Actions, **fields) -> Actions:
        running = self.running
        running.phase, running.waiting, running.succeeded = step, set(running.participants), []
        fields.setdefault("version", running.version)
        actions.sends += [(i, WeightStep(running.command.command_id, step, level=running.command.level,
                                         **fields)) for i in running.participants]
        return actions

    # -- executors answer ------------------------------------------------------------------

    def answered(self, executor: int, result: WeightResult, busy: bool) -> Actions:
        running = self.running
        if running is None or result.command_id != running.command.command_id \
                or executor not in running.waiting:
            return Actions()
        running.waiting.discard(executor)
        if result.status == 200:
            running.succeeded.append(executor)
            running.full &= result.full
            running.applied_at = max(running.applied_at or 0.0, result.applied_at or 0.0)
        elif running.failure is None:
            running.failure = result
        return self._settle(busy)

    def executor_lost(self, executor: int, busy: bool) -> Actions:
        """A participant died: it answers nothing more (it is sent the state when it is back)."""
        running = self.running
        if running is None or executor not in running.participants:
            return Actions()
        running.participants.remove(executor)
        running.waiting.discard(executor)
        if not running.participants:
            return self._finish(WeightResult(running.command.command_id, 503, "every executor "
                                             "went away meanwhile", "no_executor"), Actions())
        return self._settle(busy)

    def tick(self, busy: bool) -> Actions:
        """Called as work finishes: a drain that was waiting for it may go on."""
        if self.running is not None and self.running.phase == "drain":
            return self._drained(Actions(), busy)
        return Actions()

    def _drained(self, actions: Actions, busy: bool) -> Actions:
        if busy:
            return actions
        if self.running.command.op == SLEEP:
            return self._send(SLEEP, actions)
        actions.fail_started = actions.fail_started or TWO_VERSIONS
        return self._send(COMMIT, actions)

    def _settle(self, busy: bool) -> Actions:
        running = self.running
        if running.waiting:
            return Actions()
        command, failure = running.command, running.failure
        if running.phase == PREPARE:
            if failure is not None:
                actions = Actions(sends=[(i, WeightStep(command.command_id, DISCARD))
                                         for i in running.succeeded])
                if command.source.kind == SHARED:
                    actions.delete.append(command.source.path)
                return self._finish(failure, actions)
            running.phase = "drain"
            actions = Actions(fail_started=ABORTED if command.mode == ABORT_MODE else None)
            return self._drained(actions, busy and command.mode != ABORT_MODE)
        if running.phase == COMMIT:
            if failure is not None:  # undone where it was done
                actions = Actions(sends=[(i, WeightStep(command.command_id, SYNC, list(self.sources),
                                                        self.version)) for i in running.succeeded])
                if command.source.kind == SHARED:
                    actions.delete.append(command.source.path)
                return self._finish(failure, actions)
            kept = [command.source] if running.full else [*self.sources, command.source]
            actions = Actions(delete=[s.path for s in self.sources if s.kind == SHARED and s not in kept],
                              sync_others=set(running.participants), changed=True)
            self.sources, self.version = kept, running.version
            return self._finish(WeightResult(command.command_id, version=self.version,
                                             applied_at=running.applied_at, sleeping=self.sleeping),
                                actions)
        if failure is not None:
            return self._finish(failure, Actions())
        self.sleeping = command.level if command.op == SLEEP else 0
        return self._finish(WeightResult(command.command_id, version=self.version,
                                         sleeping=self.sleeping), Actions(changed=True))

    def _finish(self, answer: WeightResult, actions: Actions) -> Actions:
        self.running = None
        actions.answer = WeightResult(answer.command_id, answer.status, answer.error, answer.code,
                                      self.version, answer.applied_at, self.sleeping)
        actions.hold = self.holds_queue
        return actions

    # -- an executor (re)starts ------------------------------------------------------------

    def catch_up(self, command_id: str) -> list[WeightStep]:
        """What an executor that loaded the model is sent before any work."""
        steps = []
        if self.sources or self.version != BASE_VERSION:
            steps.append(WeightStep(command_id, SYNC, list(self.sources), self.version))
        if self.sleeping:
            steps.append(WeightStep(command_id, SLEEP, level=self.sleeping))
        return steps

    def state_steps(self, command_id: str) -> list[WeightStep]:
        """The current state for a ready executor that missed a command."""
        return [WeightStep(command_id, SYNC, list(self.sources), self.version)]
