"""The ``cache`` scenario of ``compare.py``: ``--step-cache first-block`` at each threshold of
``--cache-thresholds`` (0 first: the uncached reference), one server each, in one sitting.

Per threshold: saturated images/s at ``--concurrency`` (closed loop), the fraction of the
denoiser's rows that reused their cache (``diffserve_step_cache_rows_total``, warm-up included),
and the quality: ``--cache-images`` fixed prompts and seeds, sent together so that they share
forwards, each compared with its twin from the threshold-0 server (same prompt, seed, steps):
PSNR in dB, lowest and median. The headline is the best speed-up among the thresholds whose
lowest PSNR is at least 30 dB.
"""

from __future__ import annotations

import asyncio
import math

import aiohttp
import numpy as np

import kit
from kit import Bench, Scenario, ratio

QUALITY_DB = 30.0
BEST = f"best img/s / uncached at PSNR >= {QUALITY_DB:g} dB"


def cache(b: Bench) -> dict[str, float | None]:
    a, f = b.args, {}
    thresholds = sorted(set([0.0, *a.cache_thresholds]))
    twins: list[np.ndarray] | None = None
    for threshold in thresholds:
        name = f"threshold {threshold:g}"
        config = {"--batching-mode": "step", "--step-cache": "first-block", "--cache-threshold": threshold}
        with b.servers(name, config) as served:
            url = served.urls[0]
            before = kit.metrics(url)
            result = b.load(served, name, max_concurrency=a.concurrency)
            after = kit.metrics(url)
            images = asyncio.run(_sample(url, a.cache_images, a.steps, a.size))
        f[f"img/s, {name}"] = result["images_per_s"]
        hit, miss = ((kit.total(after, "diffserve_step_cache_rows_total", outcome=k) or 0.0)
                     - (kit.total(before, "diffserve_step_cache_rows_total", outcome=k) or 0.0)
                     for k in ("hit", "miss"))
        f[f"rows that hit, {name}"] = hit / (hit + miss) if hit + miss else None
        if twins is None:
            twins = images
            continue
        scores = [psnr(x, y) for x, y in zip(images, twins)]
        f[f"PSNR min dB, {name}"] = min(scores)
        f[f"PSNR median dB, {name}"] = float(np.median(scores))
        f[f"img/s, {name} / uncached"] = ratio(result["images_per_s"], f["img/s, threshold 0"])
    kept = [f[f"img/s, threshold {t:g} / uncached"] for t in thresholds[1:]
            if f.get(f"PSNR min dB, threshold {t:g}", 0) >= QUALITY_DB
            and f.get(f"img/s, threshold {t:g} / uncached") is not None]
    f[BEST] = max(kept) if kept else None
    return f


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


async def _sample(url: str, count: int, steps: int | None, size: str | None) -> list[np.ndarray]:
    """``count`` images of fixed prompts and seeds, requested together."""
    extra = {**({"num_inference_steps": steps} if steps else {}), **({"size": size} if size else {})}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as client:
        async def one(i: int) -> np.ndarray:
            body = {"prompt": f"a coloured shape, number {i}", "seed": 7919 * i, **extra}
            async with client.post(url + kit.ENDPOINT, json=body, raise_for_status=True) as response:
                return kit.decode((await response.json())["data"][0]["b64_json"])

        return await kit.drive(one, count)


def cache_args(p) -> None:
    p.add_argument("--cache-thresholds", type=kit.floats, default=[0.1, 0.3],
                   help="cache: the thresholds besides 0.")
    p.add_argument("--cache-images", type=int, default=16,
                   help="cache: images compared with their uncached twins per threshold.")


SCENARIOS = {"cache": Scenario(cache, [(BEST, ">=", 1.4)], cache_args)}
