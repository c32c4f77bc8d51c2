"""The step engine's records (:mod:`diffserve.executor.step.engine`): a :class:`Unit` of the
running set, a :class:`Waiting` item that waits in the engine for adapter slots, and the
:class:`StepOutput` one step gives back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diffserve.executor.families.conditioning import Prepared
from diffserve.executor.results import Outcome, PartialImage
from diffserve.executor.step.rollout import Trajectory
from diffserve.policies.base import Member
from diffserve.wire.protocol import STEP_MODE, key_mode
from diffserve.wire.request import WorkItem


@dataclass
class Unit:
    """One work item in the running set: ``k`` images of one request, on its own schedule."""

    item: WorkItem
    batch_key: tuple  # what must match within one forward: the running set it belongs to
    scheduler: Any
    prepared: Prepared
    cfg: bool
    partial_at: dict[int, int]
    admitted_at: float
    member: Member  # its time since it arrived and its steps, for the choice of set
    prompt_tokens: int = 0
    step: int = 0
    adapters: tuple = ()  # its LoRA stack, in the versions it holds until it leaves
    trajectory: Trajectory | None = None  # rollouts: the stochastic sampler's record
    threshold: float = 0.0  # its step cache's threshold (0: never reuse)
    cache: Any = None  # its images' step caches (diffserve.executor.accel.step_cache), while it runs
    # Its schedule's timesteps on the host, read once at admission: what a step decides on the
    # host from a timestep (Wan 2.2's expert, its guidance scale) reads these, never the device.
    host_timesteps: list[float] = field(default_factory=list)
    parked: dict = field(default_factory=dict)  # while paused: where its scheduler's tensors were
    cached_steps: list[int] | None = None  # once retired: per image, its steps that reused a cache

    @property
    def timestep(self) -> float:
        """This step's timestep, on the host."""
        return self.host_timesteps[self.step]

    @property
    def request(self):
        return self.item.request

    @property
    def key(self) -> tuple[str, int]:
        return self.item.key

    @property
    def cost(self) -> float:
        return self.samples * self.request.cost

    @property
    def finished(self) -> bool:
        return self.step >= len(self.prepared.timesteps)

    @property
    def samples(self) -> int:
        return self.item.samples

    @property
    def rows(self) -> int:
        """Rows of the denoiser's batch: with classifier-free guidance, two per sample."""
        return self.samples * (2 if self.cfg else 1)


@dataclass
class Waiting:
    """A work item handed to the engine that waits inside it for adapter slots."""

    item: WorkItem
    frames: list[Any]
    batch_key: tuple
    member: Member


@dataclass(frozen=True)
class StepTime:
    """A step's time as the device spent it, once read (a step late, where timing is deferred)."""

    seconds: float
    host_seconds: float  # of ``seconds``, outside the denoiser and the VAE
    samples: int  # samples its forward carried
    cost: float
    batch_key: tuple | None


@dataclass
class StepOutput:
    finished: list[Outcome] = field(default_factory=list)
    partials: list[PartialImage] = field(default_factory=list)
    samples: int = 0  # samples the forward carried
    cost: float = 0.0  # and their cost (diffserve.wire.costs)
    batch_key: tuple | None = None  # of the running set it advanced
    size: str = ""  # its rows' size, "WxH", or "mixed" where they differ
    tokens: int = 0  # image tokens the forward carried (latent cells, for a UNet)
    padding: int = 0  # tokens it padded rows of several sizes with
    sets: int = 0  # running sets held after the step
    # The steps whose time was read since the last output: this step's own, or (timing deferred
    # on CUDA) the one before; ``seconds`` and ``host_seconds`` sum them.
    timed: list[StepTime] = field(default_factory=list)
    seconds: float = 0.0
    host_seconds: float = 0.0  # of ``seconds``, outside the denoiser and the VAE
    cache_hits: int = 0  # rows of the forward that reused their step cache
    cache_misses: int = 0  # and rows that computed every block
    cache_bytes: int | None = None  # held by the step caches after the step (None: none run)
    progress: list[tuple[str, int, int]] = field(default_factory=list)  # (id, done, total)
    # The stages since the last step, by stage: the time the loop waited for (or, inline, ran)
    # their work, the time they worked, and the jobs they hold now.
    stage_stall: dict[str, float] = field(default_factory=dict)
    stage_busy: dict[str, float] = field(default_factory=dict)
    stage_depth: dict[str, int] = field(default_factory=dict)
    prompt_cache: tuple[int, int] | None = None  # (hits, misses), where a prompt cache is kept
    running_cost: float = 0.0  # of every request running after the step


def batch_key_of(item: WorkItem, mixed: frozenset[str] = frozenset()) -> tuple:
    """The item's running set: the key the queue computed, else (an item that did not come
    through the scheduler's queue) computed here, once; ``mixed``: the mode keys whose sizes
    share a forward."""
    return item.batch_key or item.request.batch_key(
        key_mode(STEP_MODE, item.request.mode_key in mixed))


def count_tokens(family, units: list[Unit], out: StepOutput) -> None:
    """A forward's image tokens, its padding (rows of several sizes pad to the longest, or to
    one grid) and its size ("WxH", or "mixed"), into ``out``."""
    tokens = [(u.rows, family.row_tokens(u.prepared.latents)) for u in units]
    out.tokens = sum(rows * t for rows, t in tokens)
    sizes = {(u.request.width, u.request.height, u.request.num_frames) for u in units}
    if len(sizes) > 1:
        padded = family.padded_tokens([u.prepared.latents for u in units])
        out.padding = sum(rows * (padded - t) for rows, t in tokens)
    out.size = "mixed" if len(sizes) > 1 else "{}x{}".format(*sizes.pop()[:2])
