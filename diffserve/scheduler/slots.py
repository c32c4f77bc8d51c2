"""What the scheduler knows an executor holds: the items sent to it and not yet answered, grouped
by signature into the running sets they form (in request mode: its one batch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffserve.protocol import WorkItem


@dataclass
class RunningSet:
    """What an executor holds of one signature (in request mode: its one batch)."""

    samples: int = 0
    cost: float = 0.0


@dataclass
class ExecutorSlot:
    index: int
    ready: bool = False
    items: dict[tuple[str, int], tuple[WorkItem, tuple]] = field(default_factory=dict)
    sets: dict[tuple, RunningSet] = field(default_factory=dict)  # signature -> its set
    free_since: float = 0.0  # when it last had nothing to do

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.sets.values())

    @property
    def cost(self) -> float:
        return sum(s.cost for s in self.sets.values())

    def holds(self, request_id: str) -> bool:
        return any(key[0] == request_id for key in self.items)

    def put(self, item: WorkItem, signature: tuple) -> None:
        self.items[item.key] = (item, signature)
        running = self.sets.setdefault(signature, RunningSet())
        running.samples += item.samples
        running.cost += item.samples * item.request.cost

    def get(self, key: tuple[str, int]) -> WorkItem | None:
        held = self.items.get(key)
        return None if held is None else held[0]

    def take(self, key: tuple[str, int]) -> WorkItem:
        item, signature = self.items.pop(key)
        running = self.sets[signature]
        running.samples -= item.samples
        running.cost -= item.samples * item.request.cost
        if running.samples == 0:
            del self.sets[signature]
        return item
