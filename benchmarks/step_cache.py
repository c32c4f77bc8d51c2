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
import base64
import io
import math

import httpx
import numpy as np

from bench_round import Bench
from figures import ratio

QUALITY_DB = 30.0


def cache(b: Bench) -> dict[str, float | None]:
    a, f = b.args, {}
    thresholds = sorted(set([0.0, *a.cache_thresholds]))
    twins: list[np.ndarray] | None = None
    for threshold in thresholds:
        name = f"threshold {threshold:g}"
        config = {"--batching-mode": "step", "--step-cache": "first-block",
                  "--cache-threshold": threshold}
        with b.servers(name, config) as served:
            url = served[0][0]
            before = _rows(url)
            result = b.load(served, name, max_concurrency=a.concurrency)
            after = _rows(url)
            images = asyncio.run(_sample(url, a.cache_images, a.steps, a.size))
        f[f"img/s, {name}"] = result["images_per_s"]
        hit, miss = (after[k] - before[k] for k in ("hit", "miss"))
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
    f[f"best img/s / uncached at PSNR >= {QUALITY_DB:g} dB"] = max(kept) if kept else None
    return f


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def _rows(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    counts = {"hit": 0.0, "miss": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name == "diffserve_step_cache_rows":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["outcome"]] += sample.value
    return counts


async def _sample(url: str, count: int, steps: int | None, size: str | None) -> list[np.ndarray]:
    """``count`` images of fixed prompts and seeds, requested together."""
    from PIL import Image

    extra = {**({"num_inference_steps": steps} if steps else {}), **({"size": size} if size else {})}
    async with httpx.AsyncClient(timeout=3600) as client:
        answers = await asyncio.gather(*(client.post(url + "/v1/images/generations", json={
            "prompt": f"a coloured shape, number {i}", "seed": 7919 * i, **extra})
            for i in range(count)))
    images = []
    for answer in answers:
        answer.raise_for_status()
        data = base64.b64decode(answer.json()["data"][0]["b64_json"])
        images.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    return images
