"""The pipeline families the step engine knows, found by the loaded pipeline's class."""

from __future__ import annotations

from functools import cache

from diffserve.executor.blocks import BlockTables, declared
from diffserve.executor.families.base import Family
from diffserve.executor.families.chroma import Chroma
from diffserve.executor.families.flux import Flux
from diffserve.executor.families.flux2 import Flux2, Flux2Klein
from diffserve.executor.families.flux_kontext import FluxKontext
from diffserve.executor.families.pixart import PixArtSigma
from diffserve.executor.families.qwen_image import QwenImage
from diffserve.executor.families.qwen_image_edit import QwenImageEdit, QwenImageEditPlus
from diffserve.executor.families.sana import Sana
from diffserve.executor.families.sd import StableDiffusion
from diffserve.executor.families.sd3 import StableDiffusion3
from diffserve.executor.families.sdxl import StableDiffusionXL
from diffserve.executor.families.wan import Wan, WanImageToVideo
from diffserve.executor.families.z_image import ZImage

# One line a family; where two could take a pipeline class, the first wins.
FAMILIES: tuple[type[Family], ...] = (
    StableDiffusion,
    StableDiffusionXL,
    StableDiffusion3,
    Flux,
    Flux2,
    Flux2Klein,
    FluxKontext,
    QwenImage,
    QwenImageEdit,
    QwenImageEditPlus,
    PixArtSigma,
    Sana,
    ZImage,
    Chroma,
    Wan,
    WanImageToVideo,
)


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
