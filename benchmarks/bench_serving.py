"""Load generator for image servers speaking the OpenAI images API.

Sends ``--num-prompts`` requests to ``POST {base-url}/v1/images/generations``: a closed loop
(``--max-concurrency`` in flight) or seeded Poisson arrivals (``--request-rate`` requests/s),
and reports throughput and latency. ``--mixed-steps 8,32`` draws each request's step count from
that list (seeded) and reports latency per step count. ``--base-url`` given several times (or
comma-separated) sends the requests round-robin over those servers. Where the servers expose
diffserve's /metrics, it also reports what they did (batch sizes, queue time, executor busy share,
where a request's time went), from the change in /metrics summed over the servers.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --num-prompts 200 --max-concurrency 16 --steps 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

import server_metrics

PROMPTS = Path(__file__).resolve().parent / "prompts.txt"
ENDPOINT = "/v1/images/generations"


@dataclass
class BenchConfig:
    base_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    num_prompts: int = 200
    max_concurrency: int | None = None
    request_rate: float = math.inf
    size: str | None = None
    steps: int | None = None
    mixed_steps: list[int] | None = None
    # Sizes to mix: in turn, or drawn with --size-weights (seeded); latency is reported per size.
    sizes: list[str] | None = None
    size_weights: list[float] | None = None
    models: list[str] | None = None  # `model` of request i: models[i % len] (e.g. LoRA adapters)
    n: int = 1
    seed: int = 0
    warmup: int = 2  # per base URL
    output_format: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    label: str | None = None


def build_payloads(cfg: BenchConfig, count: int, rng: random.Random) -> list[dict[str, Any]]:
    """``count`` request bodies: prompts from prompts.txt (shuffled, cycled), distinct seeds,
    and each one's step count (from --mixed-steps, drawn with ``rng``)."""
    pool = [line.strip() for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    pool = [p for p in pool if p and not p.startswith("#")]
    prompts: list[str] = []
    while len(prompts) < count:
        prompts += rng.sample(pool, len(pool))
    seed_base = cfg.seed * 1_000_003 % 2**31
    bodies = []
    for i, prompt in enumerate(prompts[:count]):
        body = {"prompt": prompt, "n": cfg.n, "seed": seed_base + i * cfg.n,  # n seeds from there
                "num_inference_steps": rng.choice(cfg.mixed_steps) if cfg.mixed_steps else cfg.steps,
                "size": _size(cfg, i, rng), "output_format": cfg.output_format,
                "model": cfg.models[i % len(cfg.models)] if cfg.models else None}
        bodies.append({**{k: v for k, v in body.items() if v is not None}, **cfg.extra_body})
    return bodies


def _size(cfg: BenchConfig, i: int, rng: random.Random) -> str | None:
    if not cfg.sizes:
        return cfg.size
    if cfg.size_weights:
        return rng.choices(cfg.sizes, cfg.size_weights)[0]
    return cfg.sizes[i % len(cfg.sizes)]


async def send(client: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One request: {ok, latency_s, images, error}. Latency ends with the body read and parsed."""
    start = time.perf_counter()
    try:
        async with client.post(url + ENDPOINT, data=json.dumps(body),
                               headers={"Content-Type": "application/json"}) as response:
            raw, status = await response.read(), response.status
        if status != 200:
            return {"ok": False, "latency_s": time.perf_counter() - start, "images": 0,
                    "error": f"HTTP {status}: {raw[:300].decode('utf-8', 'replace')}"}
        images = sum(1 for d in json.loads(raw).get("data") or [] if d.get("b64_json") or d.get("url"))
        ok = images == body["n"]
        return {"ok": ok, "latency_s": time.perf_counter() - start, "images": images,
                "error": None if ok else f"expected {body['n']} images, got {images}"}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        return {"ok": False, "latency_s": time.perf_counter() - start, "images": 0,
                "error": f"{type(error).__name__}: {error}"[:200]}


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(("count", "mean", "p50", "p90", "p99", "max"))
    a = np.asarray(values)
    return {"count": len(values), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


async def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """One run against ``cfg.base_urls``; returns what --output-file holds."""
    if cfg.num_prompts < 1 or (cfg.max_concurrency or 1) < 1 or not cfg.request_rate > 0:
        raise ValueError("num_prompts and max_concurrency must be >= 1 and request_rate > 0")
    urls = [u.rstrip("/") for u in cfg.base_urls]
    rng = random.Random(cfg.seed)
    warm = build_payloads(cfg, cfg.warmup * len(urls), random.Random(cfg.seed - 1))
    bodies = build_payloads(cfg, cfg.num_prompts, rng)
    arrivals = [0.0] * len(bodies)
    if not math.isinf(cfg.request_rate):
        arrivals = list(np.cumsum([0.0] + [rng.expovariate(cfg.request_rate) for _ in bodies[1:]]))
    limit = asyncio.Semaphore(cfg.max_concurrency or len(bodies))
    connector = aiohttp.TCPConnector(limit=min(cfg.max_concurrency or len(bodies), len(bodies)) + 4)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as client:
        async def one(i: int, body: dict) -> dict:
            async with limit:  # time waiting for a free slot is not latency
                return await send(client, urls[i % len(urls)], body)

        if warm:
            done = await asyncio.gather(*(one(i, b) for i, b in enumerate(warm)))
            if not any(o["ok"] for o in done):
                raise RuntimeError(f"every warm-up request failed; first error: {done[0]['error']}")
        before = await server_metrics.fetch(client, urls)
        start, tasks = time.perf_counter(), []
        for i, (body, at) in enumerate(zip(bodies, arrivals)):
            if (delay := start + at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, body)))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await server_metrics.fetch(client, urls)

    ok = [(b, o) for b, o in zip(bodies, outcomes) if o["ok"]]
    errors = dict(Counter(o["error"] for o in outcomes if not o["ok"]))
    latency = percentiles([o["latency_s"] for _, o in ok])
    by_steps = {str(k): percentiles([o["latency_s"] for b, o in ok if b.get("num_inference_steps") == k])
                for k in sorted(set(cfg.mixed_steps or []))}
    by_size = {size: percentiles([o["latency_s"] for b, o in ok if b.get("size") == size])
               for size in dict.fromkeys(cfg.sizes or [])}
    images = sum(o["images"] for _, o in ok)
    config = {**asdict(cfg), "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate}
    return {"label": cfg.label, "base_urls": urls, "config": config, "duration_s": duration,
            "completed": len(ok), "failed": len(outcomes) - len(ok), "images": images,
            "requests_per_s": len(ok) / duration, "images_per_s": images / duration,
            "latency_s": latency, "latency_by_steps_s": by_steps, "latency_by_size_s": by_size,
            "latencies_s": [round(o["latency_s"], 6) for _, o in ok], "errors": errors,
            "server_metrics": server_metrics.delta(before, after, duration, latency["mean"])}


def format_report(r: dict) -> str:
    ms = lambda v: "n/a" if v is None else f"{1000 * v:.1f}"  # noqa: E731
    lat, sm = r["latency_s"], r["server_metrics"]
    rows = [("Base URLs", ", ".join(r["base_urls"])), ("Request rate (req/s)", r["config"]["request_rate"]),
            ("Max concurrency", r["config"]["max_concurrency"] or "unlimited"),
            ("Duration (s)", f"{r['duration_s']:.2f}"),
            ("Completed / failed", f"{r['completed']} / {r['failed']}"),
            ("Throughput (requests/s)", f"{r['requests_per_s']:.2f}"),
            ("Throughput (images/s)", f"{r['images_per_s']:.2f}"),
            ("Latency mean/p50/p90/p99 (ms)", " / ".join(ms(lat[k]) for k in ("mean", "p50", "p90", "p99")))]
    rows += [(f"  {steps} steps: mean/p50/p99 (ms)", " / ".join(ms(v[k]) for k in ("mean", "p50", "p99"))
              + f" ({v['count'] or 0} requests)") for steps, v in r["latency_by_steps_s"].items()]
    rows += [(f"  {size}: mean/p50/p99 (ms)", " / ".join(ms(v[k]) for k in ("mean", "p50", "p99"))
              + f" ({v['count'] or 0} requests)") for size, v in r.get("latency_by_size_s", {}).items()]
    if sm:
        rows += [("Server: mode, executors", f"{sm['batching_mode']}, {sm['executors']:.0f}"),
                 ("Server: dispatches", f"{sm['dispatches']:.0f} (" + ", ".join(
                     f"{reason} {count:.0f}" for reason, count in sm["dispatches_by_reason"].items()) + ")"),
                 ("Server: mean batch / images per step", f"{sm['mean_batch_size'] or 0:.2f} / "
                  f"{sm['mean_step_running_images'] or 0:.2f}"),
                 ("Server: executor busy (%)", f"{100 * (sm['executor_busy_fraction'] or 0):.1f}"),
                 ("Server: mean request latency (ms)", ms(sm["mean_server_latency_s"])),
                 ("  of it queue time (ms)", ms(sm["mean_queue_time_s"])),
                 ("  of it execution (ms)", ms(sm["mean_request_execution_s"])),
                 ("  of it IPC, encoding, rest (ms)", ms(sm["mean_server_overhead_s"])),
                 ("Client and HTTP (ms)", ms(sm["mean_client_and_http_s"]))]
    else:
        rows.append(("Server metrics", "not available (no diffserve /metrics)"))
    rows += [("Error", f"{count} x {message}") for message, count in list(r["errors"].items())[:10]]
    title = f" {r['label'] or 'Serving benchmark'} "
    return "\n".join([title.center(64, "="), *(f"{k + ':':<38}{v}" for k, v in rows), "=" * 64])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", dest="base_urls", metavar="URL", action="append", default=None,
                   help="Server address; repeat (or comma-separate) for round-robin over several. "
                        "Default: http://127.0.0.1:8000.")
    p.add_argument("--num-prompts", "--num-requests", type=int, default=200, help="Requests after warm-up.")
    p.add_argument("--max-concurrency", type=int, default=None, help="Most in flight (default: no limit).")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Mean requests/s of Poisson arrivals (seeded); inf sends all at once.")
    p.add_argument("--size", default=None, help='e.g. "64x64" (default: the server\'s).')
    p.add_argument("--steps", type=int, default=None, help="num_inference_steps (default: the server's).")
    p.add_argument("--mixed-steps", type=lambda t: [int(v) for v in t.split(",")], default=None,
                   help="Comma-separated step counts; each request draws one (seeded).")
    p.add_argument("--sizes", type=lambda t: [v.strip() for v in t.split(",") if v.strip()],
                   default=None, help='Sizes to mix, e.g. "32x32,48x48": in turn, or drawn with '
                   "--size-weights; latency is reported per size.")
    p.add_argument("--size-weights", type=lambda t: [float(v) for v in t.split(",")], default=None,
                   help='Draw --sizes with these weights (seeded), e.g. "9,1".')
    p.add_argument("--models", type=lambda t: [v.strip() for v in t.split(",") if v.strip()],
                   default=None, help="`model` of request i is the (i mod count)-th of these "
                   "(e.g. LoRA adapters served as models).")
    p.add_argument("--n", type=int, default=1, help="Images per request.")
    p.add_argument("--seed", type=int, default=0, help="Seeds prompts, arrivals, step draws, images.")
    p.add_argument("--warmup", type=int, default=2, help="Untimed requests per base URL first.")
    p.add_argument("--output-format", choices=("png", "jpeg", "webp"), default=None)
    p.add_argument("--extra-body", type=json.loads, default={},
                   help='JSON object merged into every body, e.g. \'{"model": "m", "guidance_scale": 3}\'.')
    p.add_argument("--timeout", dest="timeout_s", type=float, default=600.0, help="Per-request timeout, s.")
    p.add_argument("--label", default=None, help="Name of this run in the report and JSON.")
    p.add_argument("--output-file", default=None, help="Write the result as JSON here.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.base_urls = [u.strip() for arg in args.base_urls or ["http://127.0.0.1:8000"]
                      for u in arg.split(",") if u.strip()]
    try:
        if not isinstance(args.extra_body, dict):
            raise ValueError("--extra-body must be a JSON object")
        cfg = BenchConfig(**{f.name: getattr(args, f.name) for f in fields(BenchConfig)})
        result = asyncio.run(run_benchmark(cfg))
    except (ValueError, RuntimeError, OSError) as error:
        print(f"bench_serving.py: error: {error}", file=sys.stderr)
        return 1
    print(format_report(result))
    if args.output_file:
        Path(args.output_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_file).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
