"""Which LoRA adapters the server serves, and runtime loads and unloads carried to every executor.

A pure object, like the scheduler core: the process wrapper sends what it decides. A command goes
to every ready executor; the server's adapter table changes only when all of them succeeded. If
some failed, the ones that succeeded are sent the unchanged table to go back to (an executor
reconciles itself with a table: loads what it lacks, unloads what is not in it). An executor that
(re)starts gets the table once it has loaded its model, so it also learns what changed while it
was away.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffserve.wire.protocol import LOAD, UNLOAD, AdapterCommand, AdapterResult


@dataclass
class _AdapterCommandRunning:
    command: AdapterCommand
    waiting: set[int]
    succeeded: list[int] = field(default_factory=list)
    failure: AdapterResult | None = None


@dataclass(frozen=True)
class AdapterOutcome:
    """What to do after an executor answered: answer the frontend (if the command is over) and
    send the table to these executors (to undo a partly failed command)."""

    answer: AdapterResult | None = None
    resync: tuple[int, ...] = ()


class AdapterRegistry:
    def __init__(self, adapters: dict[str, str]) -> None:
        self.adapters = dict(adapters)  # name -> path
        self._running: dict[str, _AdapterCommandRunning] = {}

    def table(self) -> dict[str, str]:
        return dict(self.adapters)

    def begin(self, command: AdapterCommand, ready: list[int]) -> AdapterResult | None:
        """Start a command on the ``ready`` executors; an immediate answer if there is nothing
        to do or no one to do it."""
        if command.op == UNLOAD and command.name not in self.adapters:
            return AdapterResult(command.command_id, 404, f"no adapter {command.name!r}")
        if command.op not in (LOAD, UNLOAD):
            return AdapterResult(command.command_id, 400, f"unknown adapter command {command.op!r}")
        if not ready:
            return AdapterResult(command.command_id, 503, "no executor is serving; retry shortly")
        self._running[command.command_id] = _AdapterCommandRunning(command, set(ready))
        return None

    def answered(self, executor: int, result: AdapterResult) -> AdapterOutcome:
        running = self._running.get(result.command_id)
        if running is None or executor not in running.waiting:
            return AdapterOutcome()
        running.waiting.discard(executor)
        if result.status == 200:
            running.succeeded.append(executor)
        elif running.failure is None:
            running.failure = result
        return self._settle(result.command_id)

    def executor_lost(self, executor: int) -> list[AdapterOutcome]:
        """An executor died: it answers nothing more (it learns the table when it is back)."""
        outcomes = []
        for command_id, running in list(self._running.items()):
            if executor in running.waiting:
                running.waiting.discard(executor)
                outcomes.append(self._settle(command_id))
        return outcomes

    def _settle(self, command_id: str) -> AdapterOutcome:
        running = self._running[command_id]
        if running.waiting:
            return AdapterOutcome()
        del self._running[command_id]
        command = running.command
        if running.failure is not None:
            return AdapterOutcome(running.failure, tuple(running.succeeded))
        if not running.succeeded:
            return AdapterOutcome(AdapterResult(command_id, 503, "every executor went away meanwhile"))
        if command.op == LOAD:
            self.adapters[command.name] = command.path
        else:
            self.adapters.pop(command.name, None)
        return AdapterOutcome(AdapterResult(command_id))
