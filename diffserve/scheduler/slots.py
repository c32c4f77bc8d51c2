"""What the scheduler knows an executor holds: the items sent to it and not yet answered, grouped
by batch key into the running sets they form (in request mode: its one batch), the LoRA adapters
their requests hold, and the items paused there (their state stays on that executor; they count
toward nothing until they resume)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from diffserve.wire.costs import TOKENS, RowCost, latent_frames
from diffserve.wire.request import WorkItem


@dataclass(frozen=True)
class Pricing:
    """How a running set's forward is priced where its rows' sizes differ (the step engine pads
    them): each row's cost at the padded size (``grid``: the tallest's height by the widest's
    width by the most frames, else the largest image's), by the model's ``row`` cost against a
    size relative to its native one (``native``: width, height, frames, the VAE's frame
    stride)."""

    grid: bool = False
    row: RowCost = TOKENS
    native: tuple[int, int, int, int] = (1, 1, 0, 1)

    @classmethod
    def of(cls, info) -> "Pricing":
        """A model's, from its information (diffserve.wire.model_info.ModelInfo)."""
        return cls(info.mixed_in_grid, RowCost.of(info.row_cost),
                   (info.width, info.height, info.num_frames, info.frame_stride))

    def size(self, width: int, height: int, frames: int) -> float:
        """A row's size relative to a native row's (its cost's p)."""
        w, h, f, stride = self.native
        return (width * height * latent_frames(frames, stride)
                / (w * h * latent_frames(f, stride)))

    def padded(self, sizes) -> float:
        """The size every row of a forward over ``sizes`` ((width, height, frames)) computes."""
        if not sizes:
            return 0.0
        if self.grid:
            return self.size(max(w for w, _, _ in sizes), max(h for _, h, _ in sizes),
                             max(f for _, _, f in sizes))
        return max(self.size(*size) for size in sizes)

    def rows(self, size, cost: float) -> float:
        """The rows an image of ``size`` and ``cost`` takes (its cost over one row's)."""
        return cost / self.row(self.size(*size))


def size_of(request) -> tuple[int, int, int]:
    return (request.width, request.height, request.num_frames)


@dataclass
class RunningSet:
    """What an executor holds of one batch key (in request mode: its one batch)."""

    samples: int = 0
    # (width, height, frames) -> (its images, their cost): a set whose rows' sizes differ (the
    # step engine mixes them in one forward) pads every row (``pricing``).
    by_size: dict[tuple[int, int, int], list] = field(default_factory=dict)
    pricing: Pricing = field(default_factory=Pricing)

    @property
    def cost(self) -> float:
        """What its forward costs: its images', each of their rows priced at the padded size
        where their sizes differ (the padding counts)."""
        if len(self.by_size) < 2:
            return sum(cost for _, cost in self.by_size.values())
        return self.rows * self.pricing.row(self.pricing.padded(self.by_size))

    @property
    def rows(self) -> float:
        """Its images' rows (two an image with guidance; its cost, over one row's)."""
        return sum(self.pricing.rows(size, cost) for size, (_, cost) in self.by_size.items())

    def change(self, item: WorkItem, sign: int) -> None:
        r = item.request
        held = self.by_size.setdefault(size_of(r), [0, 0.0])
        held[0] += sign * item.samples
        held[1] += sign * item.samples * r.cost
        self.samples += sign * item.samples
        if held[0] == 0:
            del self.by_size[size_of(r)]


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
class PaddedRoom:
    """The cost room of a running set whose rows' sizes differ (the step engine pads each): its
    ``rows`` priced at the padded size of ``sizes`` stay within ``limit``, the images that join
    counted in both."""

    rows: float
    sizes: set[tuple[int, int, int]]
    limit: float
    pricing: Pricing

    def images(self, request) -> int | float:
        """How many images of ``request`` fit (inf where it costs nothing)."""
        if request.cost <= 0:
            return math.inf
        pricing, size = self.pricing, size_of(request)
        one_row = pricing.row(pricing.padded(self.sizes | {size}))
        per_image = pricing.rows(size, request.cost)
        return max(0, math.floor((self.limit / one_row - self.rows) / per_image + 1e-9))

    def take(self, request, count: int) -> None:
        self.rows += count * self.pricing.rows(size_of(request), request.cost)
        self.sizes.add(size_of(request))


@dataclass
class Seat:
    """What an executor offers a group as the batcher forms it: which executor it is (a paused
    item resumes only where its state is), where adapters are counted, its adapter slots, and,
    for a running set that mixes sizes, its cost room with the padding counted."""

    executor: int
    adapters: AdapterRoom | None = None
    padded: PaddedRoom | None = None

    def admits(self, request, pinned: int | None) -> bool:
        return ((pinned is None or pinned == self.executor)
                and (self.adapters is None or self.adapters.fits(request.loras)))

    def images(self, request) -> int | float:
        """The most images of ``request`` its padded room takes (inf: no such bound)."""
        return math.inf if self.padded is None else self.padded.images(request)

    def take(self, request, count: int = 1) -> None:
        if self.adapters is not None:
            self.adapters.take(request.loras)
        if self.padded is not None:
            self.padded.take(request, count)


@dataclass
class ExecutorSlot:
    index: int
    ready: bool = False
    items: dict[tuple[str, int], tuple[WorkItem, tuple]] = field(default_factory=dict)
    sets: dict[tuple, RunningSet] = field(default_factory=dict)  # batch key -> its set
    adapters: Counter = field(default_factory=Counter)  # adapter name -> items holding it
    paused: dict[tuple[str, int], tuple[WorkItem, tuple]] = field(default_factory=dict)
    free_since: float = 0.0  # when it last had nothing to do
    pricing: Pricing = field(default_factory=Pricing)  # its model's, for sets that mix sizes

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
        other = ExecutorSlot(self.index, self.ready, pricing=self.pricing)
        for key, (item, batch_key) in self.items.items():
            if key not in keys:
                other.put(item, batch_key)
        return other

    def put(self, item: WorkItem, batch_key: tuple) -> None:
        self.items[item.key] = (item, batch_key)
        self.sets.setdefault(batch_key, RunningSet(pricing=self.pricing)).change(item, 1)
        self.adapters.update(name for name, _ in item.request.loras)

    def get(self, key: tuple[str, int]) -> WorkItem | None:
        held = self.items.get(key)
        return None if held is None else held[0]

    def take(self, key: tuple[str, int]) -> WorkItem:
        item, batch_key = self.items.pop(key)
        running = self.sets[batch_key]
        running.change(item, -1)
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
