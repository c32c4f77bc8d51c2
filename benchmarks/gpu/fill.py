"""``--only fill``: FLUX.1 Fill [dev] at its published size with random weights
(random:flux.1-fill-dev) in bfloat16: two inpaintings and two outpaintings (a border to fill), two
joining the running set after its first step, each against ``FluxFillPipeline`` called alone, and
the most images one forward carried."""

from __future__ import annotations

import statistics

import numpy as np

from gpu import failures, section
from kit import in_process, stats


def masks(width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """An inpainting's mask (the right half) and an outpainting's (all but the middle)."""
    half = np.zeros((height, width), np.uint8)
    half[:, width // 2:] = 255
    border = np.full((height, width), 255, np.uint8)
    border[height // 4:3 * height // 4, width // 4:3 * width // 4] = 0
    return half, border


@section("fill", families=("flux-fill",), cost=(300, 40))
def fill(ctx, family: str) -> dict:
    from diffserve.executor.checks.reference import solo

    rt = ctx.runtime(family, dtype="bfloat16", skip_startup_check=True)
    width, height = ctx.sizes[family][:2]
    its = ctx.items(rt, family, 4, "fill", task="inpaint", strength=1.0)
    rng, (half, border) = np.random.default_rng(0), masks(width, height)
    frames = {i.request.request_id: [(rng.random((height, width, 3)) * 255).astype(np.uint8),
                                     half if n % 2 == 0 else border] for n, i in enumerate(its)}
    rows, forward = [], rt.family.forward
    rt.family.forward = lambda latents, *a, **k: rows.append(latents.shape[0]) or forward(latents, *a, **k)
    try:
        outcomes = in_process.stepped(rt.step_engine(), {0: its[:2], 1: its[2:]},
                                      inputs=lambda item: frames[item.request.request_id])
    finally:
        rt.family.forward = forward
    served = {o.item.request.request_id: o.images for o in outcomes if not o.error}
    pairs = [(served[i.request.request_id].astype(int),
              solo(rt.loaded, rt.pipelines, i.request, *frames[i.request.request_id])) for i in its]
    return {"dtype": rt.loaded.dtype, "tasks": rt.info.tasks, "failed": failures(outcomes),
            "most images a forward": max(rows),
            "worst pixel diff": max(int(abs(a - b).max()) for a, b in pairs),
            "mean pixel diff": statistics.mean(float(abs(a - b).mean()) for a, b in pairs),
            "worst PSNR dB": min(stats.psnr(a, b) for a, b in pairs)}
