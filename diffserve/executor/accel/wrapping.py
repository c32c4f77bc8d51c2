"""Wrapping a block's ``forward`` on the instance, and reading or changing the rows of its call:
what the step cache and ``--compile`` do to the blocks the families declare
(:mod:`diffserve.executor.families.blocks`). The model's own loop calls the wrapper and nothing
of the model's code changes."""

from __future__ import annotations

import inspect
from functools import cache
from typing import Callable

from diffserve.executor.families.blocks import BlockKind


@cache
def parameter_names(cls: type) -> tuple[str, ...]:
    """The names of ``cls.forward``'s positional parameters, ``self`` left out."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def argument(block, args: tuple, kwargs: dict, name: str):
    """The value of argument ``name`` of a call of ``block``, given positionally or by name."""
    if name in kwargs:
        return kwargs[name]
    names = parameter_names(type(block))
    index = names.index(name) if name in names else len(args)
    return args[index] if index < len(args) else None


def map_rows(block, args: tuple, kwargs: dict, rows: int, shared: frozenset[str],
             change: Callable) -> tuple[tuple, dict]:
    """The call's arguments with ``change(tensor)`` applied to each batch-wise tensor (first
    dimension ``rows``), shared arguments left alone."""
    names = parameter_names(type(block))
    new_args = tuple(value if i < len(names) and names[i] in shared else
                     map_tensors(value, rows, change) for i, value in enumerate(args))
    new_kwargs = {k: v if k in shared else map_tensors(v, rows, change) for k, v in kwargs.items()}
    return new_args, new_kwargs


def map_tensors(value, rows: int, change: Callable):
    """``value`` with ``change`` applied to every tensor in it whose first dimension is ``rows``."""
    if hasattr(value, "shape"):
        return change(value) if value.dim() and value.shape[0] == rows else value
    if isinstance(value, tuple):
        return tuple(map_tensors(v, rows, change) for v in value)
    if isinstance(value, list):
        return [map_tensors(v, rows, change) for v in value]
    if isinstance(value, dict):
        return {k: map_tensors(v, rows, change) for k, v in value.items()}
    return value


def rows_of(block, kind: BlockKind, args: tuple, kwargs: dict) -> int:
    """The call's row count: its hidden states' first dimension."""
    return argument(block, args, kwargs, kind.hidden).shape[0]


class Wrapped:
    """A block's ``forward`` replaced on the instance: ``around(original, args, kwargs)`` runs
    instead of it. Unwrapped by :meth:`restore`."""

    def __init__(self, block, around: Callable) -> None:
        self.block = block
        self.original = block.forward
        self.around = around
        block.forward = self

    def __call__(self, *args, **kwargs):
        return self.around(self.original, args, kwargs)

    def restore(self) -> None:
        if self.block.__dict__.get("forward") is self:
            if isinstance(self.original, Wrapped):
                self.block.forward = self.original
            else:
                del self.block.forward  # the class's own method again


def wrap_forward(block, around: Callable) -> Wrapped:
    return Wrapped(block, around)
