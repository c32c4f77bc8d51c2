"""What the scheduler knows an executor holds: the items sent to it and not yet answered, grouped
by batch key into the running sets they form (in request mode: its one batch), and the LoRA
adapters their requests hold."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from diffserve.protocol import WorkItem


@dataclass
class RunningSet:
    """What an executor holds of one batch key (in request mode: its one batch)."""

    samples: int = 0
    cost: float = 0.0


@dataclass
class AdapterRoom:
    """An executor's adapter slots as placement sees them: the adapters its running requests
    hold (and those a group takes as it is formed), at most ``limit`` at once (--max-loras).
    The executor loads a request's adapters when it admits it and keeps them until it leaves, so
    a request whose adapters would not fit beside the held ones is not sent there: it would only
    wait inside the executor while counting as running here."""

    held: set[str]
    limit: int

    def fits(self, loras) -> bool:
        return len(self.held | {name for name, _ in loras}) <= self.limit

    def take(self, loras) -> None:
        self.held |= {name for name, _ in loras}


@dataclass
class ExecutorSlot:
    index: int
    ready: bool = False
    items: dict[tuple[str, int], tuple[WorkItem, tuple]] = field(default_factory=dict)
    sets: dict[tuple, RunningSet] = field(default_factory=dict)  # batch key -> its set
    adapters: Counter = field(default_factory=Counter)  # adapter name -> items holding it
    free_since: float = 0.0  # when it last had nothing to do

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.sets.values())

    @property
    def cost(self) -> float:
        return sum(s.cost for s in self.sets.values())

    def holds(self, request_id: str) -> bool:
        return any(key[0] == request_id for key in self.items)

    def adapter_room(self, limit: int, reserve=()) -> AdapterRoom | None:
        """Its adapter slots, with ``reserve`` (a stack) counted as held; None where adapters
        are not counted (``limit`` 0)."""
        if not limit:
            return None
        return AdapterRoom({*self.adapters, *(name for name, _ in reserve)}, limit)

    def put(self, item: WorkItem, batch_key: tuple) -> None:
        self.items[item.key] = (item, batch_key)
        running = self.sets.setdefault(batch_key, RunningSet())
        running.samples += item.samples
        running.cost += item.samples * item.request.cost
        self.adapters.update(name for name, _ in item.request.loras)

    def get(self, key: tuple[str, int]) -> WorkItem | None:
        held = self.items.get(key)
        return None if held is None else held[0]

    def take(self, key: tuple[str, int]) -> WorkItem:
        item, batch_key = self.items.pop(key)
        running = self.sets[batch_key]
        running.samples -= item.samples
        running.cost -= item.samples * item.request.cost
        if running.samples == 0:
            del self.sets[batch_key]
        self.adapters.subtract(name for name, _ in item.request.loras)
        self.adapters += Counter()  # drops the names no item holds any more
        return item

    def clear(self) -> None:
        self.items.clear()
        self.sets.clear()
        self.adapters.clear()
