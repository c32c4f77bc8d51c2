"""The adapters of one per-row context (:mod:`~diffserve.executor.lora.row_adapters`): each row's stack,
grouped by adapter (the rows that use it and their scales) and by distinct stack, with the index
and scale tensors made once per device and dtype, as a running set's rows stay the same from step
to step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from peft.tuners.lora import LoraLayer

from diffserve.executor.rows import on_device, selection


@dataclass
class RowPlan:
    """The adapters of one context: ``stacks[i]`` for row i, or one stack for every row
    (``count`` None). Index and scale tensors are made once per device and dtype."""

    stacks: list[tuple[tuple[str, float], ...]]
    count: int | None
    # adapter -> (rows that use it, their scales); rows None means every row
    groups: dict[str, tuple[list[int] | None, list[float]]] = field(default_factory=dict)
    _tensors: dict = field(default_factory=dict)
    subsets: dict = field(default_factory=dict)  # rows -> the plan of those rows (narrow())
    root: "RowPlan | None" = None  # a narrowed plan's whole one, whose gathered weights it shares

    def __post_init__(self) -> None:
        for i, stack in enumerate(self.stacks):
            for name, scale in stack:
                rows, scales = self.groups.setdefault(name, ([], []))
                rows.append(i)
                scales.append(scale)
        for name, (rows, scales) in self.groups.items():
            if self.count is None or rows == list(range(self.count)):
                self.groups[name] = (None, scales)
        self.kinds = len({s for s in self.stacks if s})  # distinct non-empty stacks

    def group(self, name: str, device, dtype):
        """(the rows that use ``name``: a slice or an index; its scale: a float when all those
        rows share it, else one per row)."""
        key = (name, device, dtype)
        if key not in self._tensors:
            rows, scales = self.groups[name]
            scale = scales[0] if len(set(scales)) == 1 else on_device(scales, device, dtype)
            self._tensors[key] = selection(rows, device), scale
        return self._tensors[key]

    def stack_rows(self, device):
        """For the gathered method: the distinct non-empty stacks, the rows that have one (a slice
        or an index) and each such row's index into the distinct stacks."""
        key = ("stacks", device)
        if key not in self._tensors:
            # In a canonical order: layouts of the same stacks share their gathered weights.
            distinct = (sorted({s for s in self.stacks if s}) if self.root is None
                        else self.root.stack_rows(device)[0])
            rows = [i for i, s in enumerate(self.stacks) if s]
            which = on_device([distinct.index(self.stacks[i]) for i in rows], device)
            self._tensors[key] = distinct, selection(rows, device), which
        return self._tensors[key]


def unit_scale(layer: LoraLayer, name: str) -> float:
    """An adapter's unit scale in ``layer``, the one PEFT's ``set_scale`` starts from:
    ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA)."""
    r = layer.r[name]
    return layer.lora_alpha[name] / (math.sqrt(r) if layer.use_rslora.get(name) else r)
