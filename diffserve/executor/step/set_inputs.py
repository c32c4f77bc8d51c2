"""One running set's forward, kept from step to step.

What a forward carries besides the latents and timesteps does not change while the set's
members stay the same: the stacked conditioning (for an MM-DiT at 1024x1024, megabytes of text
embeddings per row), each row's guidance value and adapter stack, where each work item's rows
lie, and which rows classifier-free guidance combines. :class:`SetInputs` builds them once, when the
set's membership changes (a join, a leave, a pause), and each step only stacks the latents and
timesteps, runs the forward, and guides.

Rows are laid out work item after work item; with classifier-free guidance an item's k images
take 2k rows, the unconditional ones first (``[neg_1..k, pos_1..k]``), as the families' pipelines
stack them. Where the set's items have different sizes (a family that mixes sizes), each row's
tokens are padded to the longest row's, and each prediction is cut back to its own
(:mod:`diffserve.executor.families.row_sizes`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from diffserve.executor.control.residuals import ControlPlan
from diffserve.executor.families.row_sizes import RowSizes, own_part, padded_rows
from diffserve.executor.rows import on_device, selection, take


class SetInputs:
    """The rows of a forward over ``units`` (each with ``rows``, ``samples``, ``cfg``,
    ``prepared``, ``adapters``, ``request``)."""

    def __init__(self, units: list, torch, control_from_positive: bool = False,
                 text_multiple: int = 1, row_tokens=lambda latents: latents.shape[1]) -> None:
        self.units = list(units)
        self.cfg = [u.cfg for u in units]
        self.offsets, at = [], 0
        for u in units:
            self.offsets.append(at)
            at += u.rows
        self.rows = at
        conds = [c for u in units for c in
                 ((u.prepared.negative, u.prepared.positive) if u.cfg else (u.prepared.positive,))]
        self.cond = type(conds[0]).cat(conds, text_multiple)
        device = units[0].prepared.latents.device
        self.guidance = on_device([float(u.request.guidance_scale) for u in units
                                   for _ in range(u.rows)], device, torch.float32)
        self.stacks = [u.adapters for u in units for _ in range(u.rows)]
        self.control = ControlPlan(units, self.offsets, control_from_positive)
        # Each row's size and image tokens (``row_tokens``: the family's count of its latents).
        sizes = RowSizes(tuple((u.request.width, u.request.height) for u in units
                               for _ in range(u.rows)),
                         tuple(row_tokens(u.prepared.latents) for u in units
                               for _ in range(u.rows)), 0,
                         tuple(tuple(u.prepared.latents.shape[1:]) for u in units
                               for _ in range(u.rows)))
        # None: one size (and, for videos, one frame count)
        self.sizes = sizes if len(set(zip(sizes.sizes, sizes.shapes))) > 1 else None
        self._torch = torch
        self._device = device
        self._guided: dict[tuple[int, ...], tuple[Any, Any]] = {}  # units -> their (neg, pos) rows

    def cached(self, step_cache, family, force: bool = False):
        """The step cache's context for one forward of these rows: each unit's images,
        threshold and step (``force``: every row computes every block); where the rows' sizes
        differ, each unit's signal and cache cover its own image tokens."""
        if step_cache is None:
            return nullcontext()
        r = self.units[0].request
        own = ((lambda u: family.cache_tokens(u.request.width, u.request.height)
                or family.row_tokens(u.prepared.latents))
               if self.sizes is not None else lambda u: None)
        return step_cache.forward(
            [step_cache.rows(u.cache, offset, u.rows, u.samples, u.threshold, u.step,
                             len(u.prepared.timesteps), force, own(u))
             for u, offset in zip(self.units, self.offsets)],
            self.rows, None if self.sizes is not None else family.cache_tokens(r.width, r.height))

    def host_timesteps(self) -> list[float]:
        """This step's timestep of each row, on the host."""
        return [u.timestep for u in self.units for _ in range(u.rows)]

    def matches(self, units: list) -> bool:
        """Whether ``units`` are this layout's members, in its order."""
        return len(units) == len(self.units) and all(a is b for a, b in zip(units, self.units))

    def inputs(self):
        """This step's stacked latents (the scheduler's input scaling applied per item) and
        timesteps, one per row."""
        torch = self._torch
        latents, timesteps = [], []
        for u in self.units:
            t = u.prepared.timesteps[u.step]
            x = u.prepared.latents
            scale = getattr(u.scheduler, "scale_model_input", None)
            if scale is not None:  # the scheduler's own rule (flow-matching ones have none)
                x = scale(x, t)
            latents += (x, x) if u.cfg else (x,)
            timesteps.append(t.expand(u.rows) if t.dim() == 0 else t.repeat(u.rows))
        stacked = torch.cat(latents) if self.sizes is None else padded_rows(torch, latents)
        return stacked, torch.cat(timesteps)

    def predictions(self, family, output) -> list:
        """Each item's noise prediction from the forward's ``output``: its rows as they are, or
        guided. Items whose guidance scale is the same this step are guided in one call."""
        by_scale: dict[float, list[int]] = {}
        for i, u in enumerate(self.units):
            if u.cfg:
                scale = family.guidance_scale(u.request, u.timestep)
                by_scale.setdefault(float(scale), []).append(i)
        predictions: list[Any] = [None] * len(self.units)
        for i, u in enumerate(self.units):
            if not u.cfg:
                predictions[i] = output[self.offsets[i]:self.offsets[i] + u.rows]
        for scale, members in by_scale.items():
            negative, positive = self._guided_rows(tuple(members))
            guided = family.guide(take(negative, output), take(positive, output), scale)
            at = 0
            for i in members:
                k = self.units[i].samples
                predictions[i] = guided[at:at + k]
                at += k
        if self.sizes is not None:  # each item's own tokens, the padding cut off
            predictions = [own_part(p, u.prepared.latents) for p, u in zip(predictions, self.units)]
        return predictions

    def _guided_rows(self, members: tuple[int, ...]):
        if members not in self._guided:
            negative, positive = [], []
            for i in members:
                start, k = self.offsets[i], self.units[i].samples
                negative += range(start, start + k)
                positive += range(start + k, start + 2 * k)
            self._guided[members] = (selection(negative, self._device),
                                     selection(positive, self._device))
        return self._guided[members]

    def cfg_branches(self) -> list[list[int]]:
        """CFG parallelism: the rows of each of the two branches. An item's unconditional rows
        go to branch 0 and its conditional ones to branch 1; the items without guidance are
        dealt out in turn. Where that would leave a branch empty, None: both run every row."""
        branches: list[list[int]] = [[], []]
        turn = 0
        for u, start in zip(self.units, self.offsets):
            if u.cfg:
                branches[0] += range(start, start + u.samples)
                branches[1] += range(start + u.samples, start + 2 * u.samples)
            else:
                branches[turn] += range(start, start + u.rows)
                turn = 1 - turn
        return branches if all(branches) else None
