"""Load generator for an image generation server speaking the OpenAI images API.

Sends ``--num-prompts`` requests to ``POST {base-url}/v1/images/generations``, either all at
once (``--request-rate inf``) or with Poisson arrivals at ``--request-rate`` requests/s,
never more than ``--max-concurrency`` in flight, and reports throughput and latency. When the
server exposes diffserve's Prometheus metrics it also reports what the scheduler did (mean
batch size, mean queue time), from the change in ``/metrics`` between the start and the end.

Works against diffserve, the baseline in naive_server.py, or any server with the same API:
``--no-extensions`` leaves out the fields the OpenAI API does not have (seed,
num_inference_steps, guidance_scale) and ``--extra-body`` adds any others.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --num-prompts 200 --max-concurrency 16 --size 64x64 --steps 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from server_metrics import fetch_metrics, metrics_delta

HERE = Path(__file__).resolve().parent
DEFAULT_PROMPT_FILE = HERE / "prompts.txt"
ENDPOINT = "/v1/images/generations"

# Words for --dataset random: prompts of random length made of common picture words.
_RANDOM_WORDS = (
    "red blue green golden silver dark bright small giant ancient modern quiet stormy foggy "
    "cat dog fox owl horse dragon robot castle city forest river mountain ocean desert garden "
    "street house tower bridge boat train flower tree cloud moon sun star lamp window door "
    "painting photo sketch render watercolor cinematic portrait landscape macro aerial night "
    "morning sunset winter summer autumn spring rain snow light shadow glass stone wood metal"
).split()


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = ENDPOINT
    model: str | None = None
    num_prompts: int = 200
    max_concurrency: int | None = None
    request_rate: float = math.inf
    size: str | None = None
    steps: int | None = None
    guidance_scale: float | None = None
    n: int = 1
    seed: int = 0
    warmup: int = 2
    dataset: str = "prompts"
    prompt_file: str = str(DEFAULT_PROMPT_FILE)
    random_prompt_words: int = 12
    output_format: str | None = None
    no_extensions: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    api_key: str | None = None
    disable_tqdm: bool = False
    label: str | None = None


# ---------------------------------------------------------------------------------------------
# Prompts and payloads


def load_prompts(cfg: BenchConfig, count: int, rng: random.Random) -> list[str]:
    """``count`` prompts: from the prompt file (shuffled, cycled) or random words."""
    if cfg.dataset == "random":
        return [" ".join(rng.choice(_RANDOM_WORDS)
                         for _ in range(max(1, round(rng.uniform(0.5, 1.5) * cfg.random_prompt_words))))
                for _ in range(count)]
    lines = [line.strip() for line in Path(cfg.prompt_file).read_text(encoding="utf-8").splitlines()]
    pool = [line for line in lines if line and not line.startswith("#")]
    if not pool:
        raise ValueError(f"{cfg.prompt_file} holds no prompts")
    order: list[str] = []
    while len(order) < count:
        batch = pool[:]
        rng.shuffle(batch)
        order.extend(batch)
    return order[:count]


def build_payload(cfg: BenchConfig, prompt: str, image_seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "n": cfg.n}
    if cfg.model:
        body["model"] = cfg.model
    if cfg.size:
        body["size"] = cfg.size
    if cfg.output_format:
        body["output_format"] = cfg.output_format
    if not cfg.no_extensions:
        body["seed"] = image_seed
        if cfg.steps is not None:
            body["num_inference_steps"] = cfg.steps
        if cfg.guidance_scale is not None:
            body["guidance_scale"] = cfg.guidance_scale
    body.update(cfg.extra_body)
    return body


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class _Outcome:
    ok: bool
    latency_s: float
    images: int = 0
    error: str | None = None


async def _send(client: aiohttp.ClientSession, url: str, payload: dict, expected_images: int,
                headers: dict) -> _Outcome:
    start = time.perf_counter()
    try:
        async with client.post(url, data=json.dumps(payload), headers=headers) as response:
            body = await response.read()
            status = response.status
        if status != 200:
            latency = time.perf_counter() - start
            try:
                message = json.loads(body)["error"]["message"]
            except Exception:  # noqa: BLE001 - any other error body
                message = body[:200].decode("utf-8", "replace")
            return _Outcome(False, latency, error=f"HTTP {status}: {message}")
        data = json.loads(body).get("data") or []
        images = sum(1 for item in data if item.get("b64_json") or item.get("url"))
        latency = time.perf_counter() - start  # the body is read and parsed
        if images != expected_images:
            return _Outcome(False, latency, images,
                            error=f"expected {expected_images} images, got {images}")
        return _Outcome(True, latency, images)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        return _Outcome(False, time.perf_counter() - start,
                        error=f"{type(error).__name__}: {error}"[:200])


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {k: None for k in ("mean", "p50", "p90", "p99", "min", "max")}
    arr = np.asarray(values)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99)),
            "min": float(arr.min()), "max": float(arr.max())}


async def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Run one benchmark; returns the result dict (what --output-file holds)."""
    if cfg.num_prompts < 1:
        raise ValueError("num_prompts must be at least 1")
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise ValueError("max_concurrency must be at least 1")
    if not (cfg.request_rate > 0):
        raise ValueError("request_rate must be > 0 (inf sends everything at once)")
    rng = random.Random(cfg.seed)
    prompts = load_prompts(cfg, cfg.warmup + cfg.num_prompts, rng)
    # Request i asks for seeds seed_base + i*n ... + n - 1: distinct images, same on every run.
    seed_base = cfg.seed * 1_000_003 % (2**31)
    payloads = [build_payload(cfg, p, seed_base + i * cfg.n) for i, p in enumerate(prompts)]
    warmup_payloads, payloads = payloads[:cfg.warmup], payloads[cfg.warmup:]
    if math.isinf(cfg.request_rate):
        arrivals = [0.0] * cfg.num_prompts
    else:
        t, arrivals = 0.0, []
        for _ in range(cfg.num_prompts):
            arrivals.append(t)
            t += rng.expovariate(cfg.request_rate)

    url = cfg.base_url.rstrip("/") + cfg.endpoint
    headers = {"Content-Type": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    connections = min(cfg.max_concurrency or cfg.num_prompts, cfg.num_prompts) + 4
    # aiohttp rather than httpx: about 0.4 ms less client time per request, which is part of
    # every latency measured here and CPU taken from a server on the same machine.
    connector = aiohttp.TCPConnector(limit=connections, force_close=False)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        if warmup_payloads:
            warm_limit = asyncio.Semaphore(cfg.max_concurrency or len(warmup_payloads))

            async def warm_one(payload: dict) -> _Outcome:
                async with warm_limit:
                    return await _send(client, url, payload, cfg.n, headers)

            warm = await asyncio.gather(*(warm_one(p) for p in warmup_payloads))
            if not any(o.ok for o in warm):
                raise RuntimeError(f"every warm-up request failed; first error: {warm[0].error}")
        before = await fetch_metrics(client, cfg.base_url)

        semaphore = asyncio.Semaphore(cfg.max_concurrency or cfg.num_prompts)
        progress = None
        if not cfg.disable_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=cfg.num_prompts, desc=cfg.label or "requests", unit="req",
                            file=sys.stderr, dynamic_ncols=True)

        async def one(payload: dict) -> _Outcome:
            async with semaphore:
                outcome = await _send(client, url, payload, cfg.n, headers)
            if progress is not None:
                progress.update(1)
            return outcome

        start = time.perf_counter()
        tasks = []
        for payload, at in zip(payloads, arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(payload)))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if progress is not None:
            progress.close()
        after = await fetch_metrics(client, cfg.base_url)

    done = [o for o in outcomes if o.ok]
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.error or "unknown"] = errors.get(o.error or "unknown", 0) + 1
    images = sum(o.images for o in done)
    latency = _percentiles([o.latency_s for o in done])
    server = metrics_delta(before, after, duration, latency["mean"])
    config = asdict(cfg)
    config["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    return {
        "label": cfg.label,
        "base_url": cfg.base_url,
        "config": config,
        "duration_s": duration,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "images": images,
        "requests_per_s": len(done) / duration,
        "images_per_s": images / duration,
        "latency_s": latency,
        "latencies_s": [round(o.latency_s, 6) for o in done],
        "errors": errors,
        "server_metrics": server,
    }


# ---------------------------------------------------------------------------------------------
# Report and command line


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.1f}"


def format_report(result: dict) -> str:
    cfg = result["config"]
    lat = result["latency_s"]
    title = f" Serving benchmark: {result['label']} " if result.get("label") else " Serving benchmark "
    lines = [title.center(60, "="),
             f"{'Base URL:':<36}{result['base_url']}",
             f"{'Request rate (req/s):':<36}{cfg['request_rate']}",
             f"{'Max concurrency:':<36}{cfg['max_concurrency'] or 'unlimited'}",
             f"{'Images per request (n):':<36}{cfg['n']}",
             f"{'Duration (s):':<36}{result['duration_s']:.2f}",
             f"{'Completed requests:':<36}{result['completed']}",
             f"{'Failed requests:':<36}{result['failed']}",
             f"{'Throughput (requests/s):':<36}{result['requests_per_s']:.2f}",
             f"{'Throughput (images/s):':<36}{result['images_per_s']:.2f}",
             "-" * 60,
             f"{'Mean latency (ms):':<36}{_ms(lat['mean'])}",
             f"{'P50 latency (ms):':<36}{_ms(lat['p50'])}",
             f"{'P90 latency (ms):':<36}{_ms(lat['p90'])}",
             f"{'P99 latency (ms):':<36}{_ms(lat['p99'])}"]
    sm = result.get("server_metrics")
    if sm:
        lines += ["-" * 60,
                  f"{'Server: batches run:':<36}{sm['batches']:.0f}" if sm["batches"] is not None
                  else f"{'Server: batches run:':<36}n/a",
                  f"{'Server: mean batch size (images):':<36}"
                  + ("n/a" if sm["mean_batch_size"] is None else f"{sm['mean_batch_size']:.2f}"),
                  f"{'Server: mean batch execution (ms):':<36}{_ms(sm['mean_batch_execution_s'])}",
                  f"{'Server: executor busy (% of run):':<36}"
                  + ("n/a" if sm.get("executor_busy_fraction") is None
                     else f"{100 * sm['executor_busy_fraction']:.1f}"),
                  f"{'Server: mean request latency (ms):':<36}{_ms(sm['mean_server_latency_s'])}",
                  f"{'  of it queue time (ms):':<36}{_ms(sm['mean_queue_time_s'])}",
                  f"{'  of it its pipeline calls (ms):':<36}{_ms(sm['mean_request_execution_s'])}",
                  f"{'  of it IPC, encoding, rest (ms):':<36}{_ms(sm.get('mean_server_overhead_s'))}",
                  f"{'Client and HTTP (ms):':<36}{_ms(sm.get('mean_client_and_http_s'))}"]
    else:
        lines += ["-" * 60, "Server metrics: not available (no diffserve /metrics)"]
    if result["errors"]:
        lines += ["-" * 60, "Errors:"]
        lines += [f"  {count} x {message}" for message, count in
                  sorted(result["errors"].items(), key=lambda kv: -kv[1])[:10]]
    lines.append("=" * 60)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Benchmark an image generation server (OpenAI images API): throughput, "
                    "latency and, for diffserve, batching figures from /metrics.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server address.")
    parser.add_argument("--endpoint", default=ENDPOINT, help="Path of the generation endpoint.")
    parser.add_argument("--model", default=None,
                        help="Value of the request's `model` field (left out if not given).")
    parser.add_argument("--num-prompts", type=int, default=200, help="Requests to send (after warm-up).")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="Most requests in flight at once (default: no limit).")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Mean requests/s of Poisson arrivals (seeded by --seed); inf sends "
                             "every request at once.")
    parser.add_argument("--size", default=None, help='Image size, e.g. "64x64" (default: the '
                                                     "server's native size).")
    parser.add_argument("--steps", type=int, default=None,
                        help="num_inference_steps (default: the server's).")
    parser.add_argument("--guidance-scale", type=float, default=None,
                        help="guidance_scale (default: the server's).")
    parser.add_argument("--n", type=int, default=1, help="Images per request.")
    parser.add_argument("--seed", type=int, default=0,
                        help="Seeds prompt order, arrival times and the images' seeds.")
    parser.add_argument("--warmup", type=int, default=2,
                        help="Requests sent and left out of the figures before the run.")
    parser.add_argument("--dataset", choices=("prompts", "random"), default="prompts",
                        help="prompts: lines of --prompt-file; random: random words.")
    parser.add_argument("--prompt-file", default=str(DEFAULT_PROMPT_FILE),
                        help="Prompt file, one prompt a line.")
    parser.add_argument("--random-prompt-words", type=int, default=12,
                        help="Mean words per prompt for --dataset random.")
    parser.add_argument("--output-format", choices=("png", "jpeg", "webp"), default=None,
                        help="output_format field (left out if not given).")
    parser.add_argument("--no-extensions", action="store_true",
                        help="Send only OpenAI fields (no seed, num_inference_steps, guidance_scale).")
    parser.add_argument("--extra-body", default=None,
                        help="JSON object merged into every request body.")
    parser.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout, s.")
    parser.add_argument("--api-key", default=None, help="Sent as a bearer token if given.")
    parser.add_argument("--label", default=None, help="Name for this run in the report and JSON.")
    parser.add_argument("--output-file", default=None, help="Write the result as JSON here.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    return BenchConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model,
        num_prompts=args.num_prompts, max_concurrency=args.max_concurrency,
        request_rate=args.request_rate, size=args.size, steps=args.steps,
        guidance_scale=args.guidance_scale, n=args.n, seed=args.seed, warmup=args.warmup,
        dataset=args.dataset, prompt_file=args.prompt_file,
        random_prompt_words=args.random_prompt_words, output_format=args.output_format,
        no_extensions=args.no_extensions, extra_body=extra, timeout_s=args.timeout,
        api_key=args.api_key, disable_tqdm=args.disable_tqdm, label=args.label)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        result = asyncio.run(run_benchmark(cfg))
    except (ValueError, RuntimeError, OSError) as error:
        print(f"bench_serving.py: error: {error}", file=sys.stderr)
        return 1
    print(format_report(result))
    if args.output_file:
        out = Path(args.output_file)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
