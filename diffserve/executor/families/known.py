"""The pipeline families the step engine knows (each family folder's step adapters), found by
the loaded pipeline's class, and the batching mode a pipeline runs in (the step engine where its
family is known)."""

from __future__ import annotations

from functools import cache

from diffserve.config.flags import ConfigError
from diffserve.executor.families import parts
from diffserve.executor.families.base import Family
from diffserve.executor.families.blocks import BlockTables, declared
from diffserve.wire.protocol import REQUEST_MODE, STEP_MODE

# Each folder's step adapters (its ``step`` module's ``FAMILIES``), in folder order: where two
# could take a pipeline class, the first wins.
FAMILIES: tuple[type[Family], ...] = tuple(
    family for module in parts("step") for family in module.FAMILIES)


def family_for(pipeline_class: str) -> type[Family] | None:
    for family in FAMILIES:
        if pipeline_class in family.pipelines:
            return family
    return None


def family_named(name: str) -> type[Family] | None:
    return next((family for family in FAMILIES if family.name == name), None)


def supported_pipelines() -> list[str]:
    return [name for family in FAMILIES for name in family.pipelines]


@cache
def block_tables() -> BlockTables:
    """Every family's block lists (denoiser class -> its lists in call order) and block kinds
    (block class -> how it is called), as the families declare them (``Family.block_lists``,
    ``Family.block_kinds``), for the step cache and --compile."""
    return declared(FAMILIES)


def published_dtype(pipeline_class: str | None) -> str | None:
    """The dtype the family of ``pipeline_class`` is published in (None: no family knows it)."""
    family = family_for(pipeline_class) if pipeline_class else None
    return family.published_dtype if family else None


class UnsupportedMode(ConfigError):
    """--batching-mode step on a pipeline whose family the step engine does not know."""


def resolve_mode(requested: str, family: type[Family] | None, pipeline_class: str) -> str:
    """The batching mode to run: ``auto`` takes the step engine where it knows the family."""
    if requested == STEP_MODE and family is None:
        raise UnsupportedMode(
            f"--batching-mode step does not support {pipeline_class}; it runs "
            f"{', '.join(supported_pipelines())}. Use --batching-mode request (or auto) for this "
            "model.")
    if requested == REQUEST_MODE or family is None:
        return REQUEST_MODE
    return STEP_MODE
