"""Load on the OpenAI images API: a run's settings (:class:`Load`), its bodies, arrivals and
figures (:func:`run_load`, with the servers' /metrics delta), and a tool's own requests
(:func:`image`, :func:`session`)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import aiohttp
import numpy as np
from PIL import Image

from kit.cli import prompts
from kit.server_metrics import metrics, metrics_delta

ENDPOINT = "/v1/images/generations"


@dataclass
class Load:
    """A load on the OpenAI images API; its fields are a run's JSON ``config``."""

    base_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])  # round-robin
    num_prompts: int = 200
    max_concurrency: int | None = None  # None: no limit
    request_rate: float = math.inf  # of Poisson arrivals, requests/s; inf: all at once
    size: str | None = None
    steps: int | None = None
    mixed_steps: list[int] | None = None  # each request draws its steps from these (seeded)
    sizes: list[str] | None = None  # mixed: in turn, or drawn with size_weights (seeded)
    size_weights: list[float] | None = None
    models: list[str] | None = None  # `model` of request i: models[i % len] (e.g. LoRA adapters)
    n: int = 1
    seed: int = 0
    warmup: int = 2  # per base URL
    output_format: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # e.g. an API key
    timeout_s: float = 600.0
    label: str | None = None


def payloads(cfg: Load, total: int, rng: random.Random) -> list[dict[str, Any]]:
    """``total`` request bodies: prompts from prompts.txt (shuffled, cycled), distinct seeds (n
    from each), and each one's steps and size, drawn with ``rng`` where they are mixed."""
    pool, chosen, bodies = prompts(), [], []
    while len(chosen) < total:
        chosen += rng.sample(pool, len(pool))
    for i, prompt in enumerate(chosen[:total]):
        steps = rng.choice(cfg.mixed_steps) if cfg.mixed_steps else cfg.steps  # drawn first, then the size
        size = cfg.sizes[i % len(cfg.sizes)] if cfg.sizes else cfg.size
        if cfg.sizes and cfg.size_weights:
            size = rng.choices(cfg.sizes, cfg.size_weights)[0]
        body = {"prompt": prompt, "n": cfg.n, "seed": cfg.seed * 1_000_003 % 2**31 + i * cfg.n,
                "num_inference_steps": steps, "size": size, "output_format": cfg.output_format,
                "model": cfg.models[i % len(cfg.models)] if cfg.models else None}
        bodies.append({**{k: v for k, v in body.items() if v is not None}, **cfg.extra_body})
    return bodies


async def send(client: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One request: {ok, latency_s, images, error}. Latency ends with the body read and parsed."""
    start = time.perf_counter()
    try:
        async with client.post(url + ENDPOINT, json=body) as response:
            raw, status = await response.read(), response.status
        if status != 200:
            images, error = 0, f"HTTP {status}: {raw[:300].decode('utf-8', 'replace')}"
        else:
            images = sum(1 for d in json.loads(raw).get("data") or [] if d.get("b64_json") or d.get("url"))
            error = None if images == body["n"] else f"expected {body['n']} images, got {images}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        images, error = 0, f"{type(e).__name__}: {e}"[:200]
    return {"ok": error is None, "latency_s": time.perf_counter() - start, "images": images, "error": error}


async def drive(one: Callable[[int], Any], total: int, rate: float = math.inf, concurrency: int | None = None,
                rng: random.Random | None = None) -> list:
    """``await one(i)`` for i < total at Poisson arrivals of ``rate``/s drawn from ``rng`` (the
    first at once; inf: all at once), at most ``concurrency`` in flight (a closed loop): the
    results in order. The wait for a free slot is not in ``one``'s time."""
    arrivals = [0.0] * total
    if not math.isinf(rate):
        arrivals = list(np.cumsum([0.0] + [rng.expovariate(rate) for _ in range(total - 1)]))[:total]
    limit = asyncio.Semaphore(concurrency or max(total, 1))

    async def gated(i: int):
        async with limit:
            return await one(i)

    start, tasks = time.perf_counter(), []
    for i, at in enumerate(arrivals):
        if (delay := start + at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(gated(i)))
    return list(await asyncio.gather(*tasks))


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(("count", "mean", "p50", "p90", "p99", "max"))
    a = np.asarray(values)
    return {"count": len(values), "mean": float(a.mean()),
            **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}, "max": float(a.max())}


async def run_load(cfg: Load) -> dict[str, Any]:
    """A warm-up, then ``cfg``: throughput, latency (overall, per step count, per size), the /metrics delta."""
    if cfg.num_prompts < 1 or (cfg.max_concurrency or 1) < 1 or not cfg.request_rate > 0:
        raise ValueError("num_prompts and max_concurrency must be >= 1 and request_rate > 0")
    urls, rng = [u.rstrip("/") for u in cfg.base_urls], random.Random(cfg.seed)
    warm = payloads(cfg, cfg.warmup * len(urls), random.Random(cfg.seed - 1))
    bodies = payloads(cfg, cfg.num_prompts, rng)
    slots = min(cfg.max_concurrency or len(bodies), len(bodies))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=slots + 4), headers=cfg.headers,
                                     timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as client:
        if warm:
            done = await drive(lambda i: send(client, urls[i % len(urls)], warm[i]), len(warm), concurrency=slots)
            if not any(o["ok"] for o in done):
                raise RuntimeError(f"every warm-up request failed; first error: {done[0]['error']}")
        before, start = metrics(*urls), time.perf_counter()  # nothing is in flight while they are read
        outcomes = await drive(lambda i: send(client, urls[i % len(urls)], bodies[i]), len(bodies),
                               cfg.request_rate, cfg.max_concurrency, rng)
        duration = time.perf_counter() - start
        after = metrics(*urls)
    ok = [(b, o) for b, o in zip(bodies, outcomes) if o["ok"]]
    of = lambda key, value: percentiles([o["latency_s"] for b, o in ok if b.get(key) == value])  # noqa: E731
    latency, images = percentiles([o["latency_s"] for _, o in ok]), sum(o["images"] for _, o in ok)
    return {"label": cfg.label, "base_urls": urls, "duration_s": duration,
            "config": {**asdict(cfg), "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate},
            "completed": len(ok), "failed": len(outcomes) - len(ok), "images": images,
            "requests_per_s": len(ok) / duration, "images_per_s": images / duration, "latency_s": latency,
            "latency_by_steps_s": {str(k): of("num_inference_steps", k) for k in sorted(set(cfg.mixed_steps or []))},
            "latency_by_size_s": {size: of("size", size) for size in dict.fromkeys(cfg.sizes or [])},
            "latencies_s": [round(o["latency_s"], 6) for _, o in ok],
            "errors": dict(Counter(o["error"] for o in outcomes if not o["ok"])),
            "server_metrics": metrics_delta(before, after, duration, latency["mean"])}


async def image(client: aiohttp.ClientSession, url: str, body: dict) -> np.ndarray:
    """The first image of one answer, as RGB pixels (an error status raises)."""
    async with client.post(url + ENDPOINT, json=body, raise_for_status=True) as response:
        b64 = (await response.json())["data"][0]["b64_json"]
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def session() -> aiohttp.ClientSession:
    """A client for a tool's own requests, patient with a busy machine."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))

