"""The block tables the step cache and --compile read (executor/blocks.py): declared by the
families, merged into one, and a class two families describe differently is refused."""

from __future__ import annotations

from typing import ClassVar

import pytest

from diffserve.executor.families.blocks import CROSS, JOINT, BlockKind, declared
from diffserve.executor.families.known import FAMILIES, block_tables


def test_the_families_tables_are_one_union_whatever_the_registry_order():
    lists, kinds = block_tables()
    assert lists["FluxTransformer2DModel"] == ("transformer_blocks", "single_transformer_blocks")
    assert kinds["SanaTransformerBlock"] == CROSS and kinds["JointTransformerBlock"] == JOINT
    assert (lists, kinds) == declared(FAMILIES[::-1])


def test_two_families_that_describe_one_block_class_differently_are_refused():
    class Other(FAMILIES[0]):
        name = "other"
        block_kinds: ClassVar[dict[str, BlockKind]] = {"SanaTransformerBlock": JOINT}

    with pytest.raises(ValueError, match="other and sana declare SanaTransformerBlock"):
        declared([*FAMILIES, Other])
