"""What the scheduler knows an executor holds: the items sent to it and not yet answered, grouped
by batch key into the running sets they form (in request mode: its one batch), the LoRA adapters
their requests hold, and the items paused there (their state stays on that executor; they count
toward nothing until they resume)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from diffserve.wire.request import WorkItem


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
class Seat:
    """What an executor offers a group as the batcher forms it: which executor it is (a paused
    item resumes only where its state is) and, where adapters are counted, its adapter slots."""

    executor: int
    adapters: AdapterRoom | None = None

    def admits(self, request, pinned: int | None) -> bool:
        return ((pinned is None or pinned == self.executor)
                and (self.adapters is None or self.adapters.fits(request.loras)))

    def take(self, request) -> None:
        if self.adapters is not None:
            self.adapters.take(request.loras)


@dataclass
class ExecutorSlot:
    index: int
    ready: bool = False
    items: dict[tuple[str, int], tuple[WorkItem, tuple]] = field(default_factory=dict)
    sets: dict[tuple, RunningSet] = field(default_factory=dict)  # batch key -> its set
    adapters: Counter = field(default_factory=Counter)  # adapter name -> items holding it
    paused: dict[tuple[str, int], tuple[WorkItem, tuple]] = field(default_factory=dict)
    free_since: float = 0.0  # when it last had nothing to do

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.sets.values())

    @property
    def cost(self) -> float:
        return sum(s.cost for s in self.sets.values())

    def holds(self, request_id: str) -> bool:
        """Whether it holds any part of the request, running or paused."""
        return any(key[0] == request_id for key in (*self.items, *self.paused))

    def seat(self, limit: int, reserve=()) -> Seat:
        """What it offers a group: its adapter slots (where ``limit`` counts them), with
        ``reserve`` (a stack) counted as held."""
        adapters = AdapterRoom({*self.adapters, *(name for name, _ in reserve)}, limit) if limit else None
        return Seat(self.index, adapters)

    def pause(self, key: tuple[str, int]) -> WorkItem:
        """Take a running item out of its set; it stays here, paused, and keeps its adapters
        (the executor holds them for it)."""
        batch_key = self.items[key][1]
        item = self.take(key)
        self.paused[key] = (item, batch_key)
        self.adapters.update(name for name, _ in item.request.loras)
        return item

    def unpause(self, key: tuple[str, int]) -> tuple[WorkItem, tuple]:
        """A paused item, no longer here as paused (it resumes, ends or is dropped)."""
        item, batch_key = self.paused.pop(key)
        self.adapters.subtract(name for name, _ in item.request.loras)
        self.adapters += Counter()
        return item, batch_key

    def without(self, keys) -> "ExecutorSlot":
        """What it would hold with these running items gone (for choosing what to pause)."""
        other = ExecutorSlot(self.index, self.ready)
        for key, (item, batch_key) in self.items.items():
            if key not in keys:
                other.put(item, batch_key)
        return other

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
        self.paused.clear()
