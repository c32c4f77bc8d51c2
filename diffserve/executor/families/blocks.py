"""A denoiser's repeated blocks, in the order its forward calls them, and how each block class
takes and gives back its batch, as the families declare them.

The step cache (:mod:`diffserve.executor.accel.step_cache`) runs some blocks on part of the rows, and
``--compile`` (:mod:`diffserve.executor.accel.compiled`) pads a block's rows to a bucket: both must
know which of a block's arguments hold one row per batch row (hidden states, the timestep
embedding, masks) and which every row shares (rotary embeddings, sizes). A block's arguments are
batch-wise when they are tensors whose first dimension is the call's row count, unless the
block's kind names them shared; tuples, lists and dicts are looked into.

The accelerators wrap each block's ``forward`` on the instance
(:mod:`diffserve.executor.accel.wrapping`), so the model's own loop calls the wrapper and nothing
of the model's code changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
