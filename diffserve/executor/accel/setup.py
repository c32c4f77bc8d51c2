"""What ``--step-cache``, ``--compile`` and ``--quantization`` set up on a loaded model, for
:func:`diffserve.executor.runtime.build_runtime` (quantization happens as the pipeline loads:
:mod:`diffserve.executor.model.quantization`)."""

from __future__ import annotations

import logging

from diffserve.config.flags import ServerConfig
from diffserve.wire.protocol import STEP_MODE

log = logging.getLogger(__name__)


def step_cache_for(config: ServerConfig, family, mode: str, group=None):
    """The step cache over ``family``'s denoisers where --step-cache asks for one (step mode
    only); raises, naming the denoiser, where it cannot split it. In a context-parallel group
    each rank's signal covers its share of the tokens, and its sums are reduced over the group."""
    if config.step_cache == "off":
        return None
    if mode != STEP_MODE:
        log.warning("--step-cache runs in step mode only; this model is served in %s mode "
                    "without it", mode)
        return None
    from diffserve.executor.accel.step_cache import StepCache, UnsupportedCache

    if group is not None and group.degrees.context and family.cache_tokens(64, 64) is not None:
        raise UnsupportedCache(f"--step-cache with --ulysses-degree/--ring-degree: {family.name}'s "
                               "hidden states carry image and text tokens in one sequence, which "
                               "the context split divides across ranks unevenly")
    return StepCache(family.denoisers, group.reduce_sums if group is not None else None)


def compiled_for(config: ServerConfig, loaded, family):
    """The denoisers' repeated blocks compiled, where --compile asks for it (both modes: the
    pipeline's own calls go through the same blocks)."""
    if not config.compile:
        return None
    from diffserve.executor.accel.compiled import CompiledBlocks

    denoisers = family.denoisers if family is not None else [
        getattr(loaded.pipe, "unet", None) or loaded.pipe.transformer]
    return CompiledBlocks(denoisers, loaded.device, rows=config.compile_rows,
                          graphs=config.cuda_graphs == "on")


def warm_up(rt) -> None:
    """Compile the native size's buckets before serving (step mode; request mode compiles each
    batch size at its first call), logging what it took."""
    if rt.compiled is None:
        return
    if rt.mode != STEP_MODE:
        log.info("--compile: request mode compiles each batch size and image size at its first "
                 "call")
        return
    from diffserve.executor.accel.compiled import warm_up as run

    seconds = run(rt, rt.step_engine())
    log.info("--compile: %d graphs compiled at start-up in %.1f s (the native %dx%d's buckets); "
             "other sizes and buckets compile when first needed", rt.compiled.graphs_at_start(),
             seconds, rt.info.width, rt.info.height)
