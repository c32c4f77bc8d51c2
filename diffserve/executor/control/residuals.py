"""ControlNet in a running set's forward: which rows use which control model at this step, each
model run once on the rows that use it, and its residuals added to those rows' denoiser inputs.

A request's controls travel with it (:attr:`~diffserve.executor.families.conditioning.Prepared.
controls`: each control and its condition, one row per image). For one forward, every control
model present runs once over the rows that use it (its own batch: a row that stacks the same
model twice is in it twice); each use's residuals are scaled by its control's scale and added to
its target rows of residual tensors that are zero elsewhere, so that rows without control, and
rows outside a control's window (diffusers' ``controlnet_keep``), get exactly nothing. Stacked
controls sum, as diffusers' multi-ControlNet does.

A use's source row (whose latents, timestep and prompt feed the model) is its target row, except
where the family's pipeline runs one control pass on the prompt's rows and adds it to both rows
of classifier-free guidance (Qwen-Image): there a negative row takes its positive row's residual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffserve.executor.families.row_sizes import padded_rows
from diffserve.executor.rows import on_device, selection, take


@dataclass
class Use:
    """One control of one image in a forward: the model, its source row, its target rows, its
    condition (one row), its scale and mode, and the unit it belongs to."""

    model: str
    unit: int
    control: Any  # diffserve.wire.request.Control
    condition: Any
    source: int
    targets: tuple[int, ...]


class ControlPlan:
    """The uses of a running set's forward (built once per membership, like its stacked
    inputs): ``units`` laid out at ``offsets`` (each with ``rows``, ``samples``, ``cfg``,
    ``prepared.controls``)."""

    def __init__(self, units: list, offsets: list[int], from_positive: bool) -> None:
        self.uses: list[Use] = []
        for i, (u, at) in enumerate(zip(units, offsets)):
            k = u.samples
            for control, condition in u.prepared.controls:
                for j in range(k):
                    positive = at + (k + j if u.cfg else j)
                    rows = (at + j, positive) if u.cfg else (positive,)
                    row = condition[j:j + 1]
                    if from_positive:
                        self.uses.append(Use(control.model, i, control, row, positive, rows))
                    else:
                        self.uses += [Use(control.model, i, control, row, r, (r,)) for r in rows]

    def __bool__(self) -> bool:
        return bool(self.uses)

    def active(self, units: list) -> list[Use]:
        """The uses that act at this step (each unit at its own step of its own schedule)."""
        return [use for use in self.uses
                if use.control.acts_at(units[use.unit].step, len(units[use.unit].prepared.timesteps))]


def residuals(family, uses: list[Use], latents, timesteps, cond, guidance, width: int,
              height: int, sizes=None):
    """Every control model's residuals for the forward's rows (None where no use acts): each
    model once over its uses' source rows, scaled per use, summed into its targets.
    ``sizes``: the rows' sizes, where they differ (their latents and conditions padded)."""
    if not uses:
        return None
    torch, device = family.torch, latents.device
    total = None
    by_model: dict[str, list[Use]] = {}
    for use in uses:
        by_model.setdefault(use.model, []).append(use)
    for name, group in by_model.items():
        module = family.controls[name].module
        sources = [u.source for u in group]
        source = selection(sources, device)
        modes = None
        if family.controls[name].modes:
            modes = on_device([[u.control.mode] for u in group], device)
        conditions = [u.condition for u in group]
        extra = {}
        if sizes is not None:  # rows of several sizes: their conditions padded like the latents
            extra["sizes"] = sizes.select(sources)
            conditions = [padded_rows(torch, conditions)]
        out = family.control_call(module, take(source, latents), take(source, timesteps),
                                  cond.select(source, sources), take(source, guidance),
                                  torch.cat(conditions), modes, width, height, **extra)
        scale = on_device([float(u.control.scale) for u in group], device, torch.float32)
        pairs = [(n, row) for n, u in enumerate(group) for row in u.targets]
        into = selection([row for _, row in pairs], device)
        spread = on_device([n for n, _ in pairs], device)
        rows = len(latents)

        def scaled(t):
            return (t * scale.view(-1, *([1] * (t.dim() - 1))).to(t.dtype)).index_select(0, spread)

        if total is None:
            total = tuple([t.new_zeros((rows, *t.shape[1:])) for t in part] for part in out)
        for mine, theirs in zip(total, out):
            for tensor, residual in zip(mine, theirs):
                _add(tensor, into, scaled(residual))
    return total


def _add(full, rows, part) -> None:
    if isinstance(rows, slice):
        full[rows] += part
    else:
        full.index_add_(0, rows, part)


def narrowed(control, index):
    """The residuals of the rows at ``index`` (a forward that runs part of its rows)."""
    if control is None:
        return None
    return tuple([take(index, t) for t in part] for part in control)
