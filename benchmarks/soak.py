"""Soak: a bounded load run against a real `diffserve serve`, checking that nothing is lost and
that every image is the one its own prompt and seed give when run alone.

    python benchmarks/soak.py --num-requests 2000 --concurrency 64

Starts the server itself (embedded tiny-sd, batches of 8, 8 ms delay) on a free local port,
computes the reference images in-process with the same model, and exits non-zero on any lost,
failed or mismatched request. Prints one JSON summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
from PIL import Image


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, args: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "diffserve", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:  # the server says when it listens
        if "diffserve ready: serving" in line:
            return proc
    raise RuntimeError(f"server exited with {proc.wait()} before it was ready")


def references(model: str, jobs: set[tuple[str, int]]) -> dict[tuple[str, int], np.ndarray]:
    from diffserve.executor.runner import ModelRunner
    from diffserve.protocol import Sample

    runner = ModelRunner(model, model)
    info = runner.info
    params = {"width": info.width, "height": info.height, "num_inference_steps": info.default_steps,
              "guidance_scale": info.default_guidance_scale}
    out = {}
    ordered = sorted(jobs)
    for start in range(0, len(ordered), 8):  # batched: batch-independence is tested elsewhere
        chunk = ordered[start:start + 8]
        images = runner.generate(params, [Sample("ref", 0, p, "", s) for p, s in chunk])
        out.update(zip(chunk, images))
    return out


async def load(base_url: str, plan: list[dict], concurrency: int, timeout_s: float):
    results: list = [None] * len(plan)
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        async def one(i: int, body: dict) -> None:
            async with semaphore:
                try:
                    results[i] = await client.post("/v1/images/generations", json=body)
                except httpx.HTTPError as error:
                    results[i] = error

        await asyncio.gather(*(one(i, body) for i, body in enumerate(plan)))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--distinct", type=int, default=64, help="distinct (prompt, seed) pairs")
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--server-args", default="--dynamic-batch-max-size 8 --dynamic-batch-delay-ms 8")
    args = parser.parse_args(argv)

    pairs = [(f"soak prompt {k}: {['a cat', 'a boat', 'a red circle', 'noise'][k % 4]}", 7919 * k)
             for k in range(args.distinct)]
    plan = []
    for i in range(args.num_requests):
        prompt, seed = pairs[i % len(pairs)]
        plan.append({"prompt": prompt, "seed": seed, "n": 2 if i % 3 == 0 else 1})
    expected = {(b["prompt"], b["seed"] + j) for b in plan for j in range(b["n"])}
    refs = references(args.model, expected)

    port = free_port()
    proc = start_server(port, ["--model", args.model, *args.server_args.split()])
    try:
        started = time.perf_counter()
        results = asyncio.run(load(f"http://127.0.0.1:{port}", plan, args.concurrency, args.timeout_s))
        duration = time.perf_counter() - started
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)

    lost = failed = mismatched = images = 0
    worst = 0
    for body, result in zip(plan, results):
        if not isinstance(result, httpx.Response):
            lost += 1
            continue
        if result.status_code != 200:
            failed += 1
            continue
        data = result.json()["data"]
        if [d["seed"] for d in data] != [body["seed"] + j for j in range(body["n"])]:
            mismatched += 1
            continue
        for d in data:
            pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))).convert("RGB"))
            diff = int(np.abs(pixels.astype(int) - refs[(body["prompt"], d["seed"])].astype(int)).max())
            worst = max(worst, diff)
            mismatched += diff > 2
            images += 1
    calls = next((float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("diffserve_batch_size_count ")), 0.0)
    summary = {"requests": len(plan), "concurrency": args.concurrency, "images": images,
               "lost": lost, "failed": failed, "mismatched": mismatched,
               "worst_pixel_diff": worst, "duration_s": round(duration, 2),
               "images_per_s": round(images / duration, 2), "executor_calls": calls,
               "server_exit_code": code}
    print(json.dumps(summary))
    ok = (lost == failed == mismatched == 0 and code == 0
          and images == sum(b["n"] for b in plan))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
