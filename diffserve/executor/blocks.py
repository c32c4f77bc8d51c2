"""A denoiser's repeated blocks, in the order its forward calls them, and how each block class
takes and gives back its batch.

The step cache (:mod:`diffserve.executor.step_cache`) runs some blocks on part of the rows, and
``--compile`` (:mod:`diffserve.executor.compiled`) pads a block's rows to a bucket: both must
know which of a block's arguments hold one row per batch row (hidden states, the timestep
embedding, masks) and which every row shares (rotary embeddings, sizes). A block's arguments are
batch-wise when they are tensors whose first dimension is the call's row count, unless the
block's kind names them shared; tuples, lists and dicts are looked into.

Each block's ``forward`` is wrapped on the instance (:func:`wrap_forward`), so the model's own
loop calls the wrapper and nothing of the model's code changes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable

# A denoiser class -> the attributes holding its block lists; a block class -> its kind. The
# families declare them (diffserve.executor.families.block_tables): they reach this module as
# arguments, so that nothing here imports the families, which import this module.
BlockTables = tuple[dict[str, tuple[str, ...]], dict[str, "BlockKind"]]

HIDDEN, ENCODER = "hidden", "encoder"


@dataclass(frozen=True)
class BlockKind:
    """How a block class is called and what it returns."""

    hidden: str = "hidden_states"  # the argument that carries the image tokens
    encoder: str | None = None  # the text stream's argument, for blocks that return it too
    returns: tuple[str, ...] = (HIDDEN,)  # the output's parts in order; one part: a tensor
    shared: frozenset[str] = frozenset()  # arguments every row shares

    def part(self, out, name: str):
        """Part ``name`` (HIDDEN, ENCODER) of a block's output ``out``; None where it has none."""
        if len(self.returns) == 1:
            return out if name == self.returns[0] else None
        return out[self.returns.index(name)] if name in self.returns else None

    def with_parts(self, out, parts: dict[str, Any]):
        """``out`` with the parts named in ``parts`` replaced (the others as they were)."""
        if len(self.returns) == 1:
            return parts[self.returns[0]]
        values = list(out)
        for name, value in parts.items():
            if name in self.returns:
                values[self.returns.index(name)] = value
        return tuple(values)


# The two conventions most transformer blocks follow (a family names its blocks' kinds).
JOINT = BlockKind(encoder="encoder_hidden_states", returns=(ENCODER, HIDDEN),
                  shared=frozenset({"image_rotary_emb", "joint_attention_kwargs"}))
CROSS = BlockKind(shared=frozenset({"cross_attention_kwargs", "height", "width"}))


def declared(families) -> BlockTables:
    """The union of ``families``' block tables. Families share classes (a subclass inherits its
    parent's tables; PixArt and a UNet both use BasicTransformerBlock); two that say different
    things of one class are a mistake, refused here rather than decided by registry order."""
    lists: dict[str, tuple[str, ...]] = {}
    kinds: dict[str, BlockKind] = {}
    said_by: dict[str, str] = {}
    for family in families:
        for table, entries in ((lists, family.block_lists), (kinds, family.block_kinds)):
            for name, value in entries.items():
                if table.setdefault(name, value) != value:
                    raise ValueError(f"{family.name} and {said_by[name]} declare {name} "
                                     "differently")
                said_by.setdefault(name, family.name)
    return lists, kinds


def transformer_blocks(denoiser, tables: BlockTables) -> list[tuple[Any, BlockKind]]:
    """The transformer's blocks in call order with their kinds, by ``tables``; ValueError where
    it is not one they know."""
    name = type(denoiser).__name__
    block_lists, block_kinds = tables
    if name not in block_lists:
        raise ValueError(f"{name} is not a denoiser whose blocks the server knows (it knows "
                         f"{', '.join(sorted(block_lists))} and UNet2DConditionModel)")
    blocks = [block for attr in block_lists[name] for block in getattr(denoiser, attr)]
    kinds = []
    for block in blocks:
        kind = block_kinds.get(type(block).__name__)
        if kind is None:
            raise ValueError(f"{name} has a block {type(block).__name__} the server does not know")
        kinds.append((block, kind))
    return kinds


def is_unet(denoiser) -> bool:
    return type(denoiser).__name__ == "UNet2DConditionModel"


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
