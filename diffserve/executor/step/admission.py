"""What a work item becomes when it joins the step engine's running set
(:mod:`diffserve.executor.step.engine`): its prompts encoded with its own adapters, its own
noise scheduler, generators, schedule and first latents, a :class:`~diffserve.executor.step.units.Unit`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable

from diffserve.executor.families.base import Family
from diffserve.executor.families.conditioning import Encoded
from diffserve.executor.step.prompt_cache import prompt_key
from diffserve.executor.results import partial_steps
from diffserve.executor.step.rollout import Trajectory
from diffserve.executor.step.units import Unit, batch_key_of
from diffserve.policies.base import Member
from diffserve.wire.request import WorkItem
from diffserve.wire.samples import generators, group_by, input_arrays
from diffserve.wire.tasks import REFERENCE


class UnitBuilder:
    def __init__(self, family: Family, count_tokens: Callable[[str], int],
                 rows: Callable[[list], AbstractContextManager], step_cache=None,
                 cache_threshold: float = 0.0, prompt_cache=None,
                 mixed_sizes: frozenset[str] = frozenset()) -> None:
        """``rows(stacks)``: the context in which row i of every adapted call gets
        ``stacks[i]``. ``step_cache`` and ``cache_threshold``: the engine's step cache, if any,
        and the threshold of requests that name none. ``prompt_cache``: encodings kept for the
        next request that asks for the same (:mod:`diffserve.executor.step.prompt_cache`), if any."""
        self.family = family
        self.prompt_cache = prompt_cache
        self.count_tokens = count_tokens
        self.rows = rows
        self.step_cache = step_cache
        self.cache_threshold = cache_threshold
        self.mixed_sizes = mixed_sizes  # mode keys whose sizes share a running set

    def encode(self, items: list[WorkItem], stacks: list, frames: list[list[Any]]) -> list[Encoded]:
        """Every item's text conditioning (one row per image), in one encoder call per group:
        the requests with a negative prompt, and the rest (which some families encode
        differently). Each prompt row is encoded with its own request's adapters (and, where the
        family's text encoder sees them, its reference images)."""
        fam, cache = self.family, self.prompt_cache
        cfg = [fam.uses_cfg(i.request.guidance_scale, i.request.negative_prompt) for i in items]
        negative = lambda i: cfg[i] and bool(items[i].request.negative_prompt)  # noqa: E731
        seen = ([input_arrays(item.request, f).get(REFERENCE.name) for item, f in zip(items, frames)]
                if fam.encodes_references else None)
        key = cache.key if cache is not None else prompt_key
        keys = [key(item.request, cfg[i], negative(i), stacks[i], seen[i] if seen else None)
                for i, item in enumerate(items)]
        rows: list[Encoded | None] = (cache.lookup(keys) if cache is not None
                                      else [None] * len(items))
        # A prompt encoded once per call however many requests repeat it (an RL group's samples).
        first: dict[tuple, int] = {}
        for i in range(len(items)):
            if rows[i] is None:
                first.setdefault(keys[i], i)
        for with_negative, group in group_by(list(first.values()), negative).items():
            extra = {"references": [seen[i] for i in group]} if seen is not None else {}
            with self.rows([stacks[i] for i in group]):
                both = fam.encode([items[i].request.prompt for i in group],
                                  [items[i].request.negative_prompt for i in group] if with_negative
                                  else None, any(cfg[i] for i in group), **extra)
            for row, i in enumerate(group):
                rows[i] = Encoded(both.positive.rows(row, row + 1),
                                  both.negative.rows(row, row + 1) if cfg[i] else None)
                if cache is not None:
                    cache.put(keys[i], rows[i])
        rows = [rows[i] if rows[i] is not None else rows[first[keys[i]]] for i in range(len(items))]
        return [Encoded(r.positive.repeat(item.samples),
                        r.negative.repeat(item.samples) if r.negative is not None else None)
                for r, item in zip(rows, items)]

    def unit(self, item: WorkItem, frames: list[Any], encoded: Encoded, start: float,
             stack: tuple, arrived: float) -> Unit:
        """``item`` as a member of the running set, admitted at ``start``; ``stack``: the
        adapter versions it holds; ``arrived``: when it reached the scheduler."""
        fam, r = self.family, item.request
        scheduler = fam.new_scheduler(r.scheduler)
        gens = generators(r, item.start, item.stop)
        prepared = fam.prepare(r.task_spec, scheduler, r.num_inference_steps, r.strength, r.width,
                               r.height, gens, encoded, input_arrays(r, frames),
                               frames=r.num_frames, controls=r.controls)
        # A rollout's noise comes from the same generators, after its first latents'.
        trajectory = Trajectory(r.noise_level, gens) if r.task_spec.trajectory else None
        threshold = self.threshold(r)
        return Unit(item, batch_key_of(item, self.mixed_sizes), scheduler, prepared, prepared.negative is not None,
                    partial_steps(r.partial_images, len(prepared.timesteps)), start,
                    Member(arrived, len(prepared.timesteps)),
                    self.count_tokens(r.prompt), adapters=stack, trajectory=trajectory,
                    threshold=threshold,
                    cache=self.step_cache.unit(item.samples) if threshold > 0 else None,
                    host_timesteps=[float(t) for t in prepared.timesteps.tolist()])

    def threshold(self, r) -> float:
        """The request's step-cache threshold: its own, else the server's. 0 without a step
        cache, and for rollouts, whose log-probabilities are of the model's own predictions."""
        if self.step_cache is None or r.task_spec.trajectory:
            return 0.0
        return self.cache_threshold if r.cache_threshold is None else r.cache_threshold
