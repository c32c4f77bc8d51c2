"""Interactive and batch classes on one server: a saturating batch class (``--batch-steps``
steps, closed loop of ``--batch-clients``, its API key at class 10) beside an interactive class
(``--interactive-steps`` steps, class 0, Poisson arrivals at ``--interactive-load`` percent of
the interactive capacity), under ``--scheduling-policy fcfs`` and ``priority``, one server each,
in ``--rounds`` rounds (fresh servers each).

Per round: the interactive capacity (saturated req/s of interactive requests alone, fcfs server),
the interactive latency alone (idle server, median), then the mixed load on each server: the
interactive p50/p99 and the batch class's images/s. At the end every batch image of the priority
server (some of them paused and resumed) is checked against the plain pipeline alone.

    python benchmarks/bench_priorities.py --model shapes --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the plain pipeline's reference call

from diffserve.launcher import ServerProcess  # noqa: E402

PRODUCT, TRAINER = "product-key", "trainer-key"


def server(policy: str, a) -> ServerProcess:
    trainer = f"{TRAINER}:10" if policy == "priority" else TRAINER
    log = Path(tempfile.mkdtemp(prefix=f"bench-priorities-{policy}-")) / "server.log"
    return ServerProcess.diffserve(
        "--model", a.model, "--scheduling-policy", policy, "--priority-aging-s", str(a.aging),
        "--api-key", PRODUCT, "--api-key", trainer, "--dynamic-batch-max-size", str(a.max_batch),
        "--max-inference-steps", "1000", "--torch-threads", str(a.torch_threads),
        "--log-level", "warning", log_path=log, startup_timeout_s=900)


async def generate(client, url, key, prompt, seed, steps) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    r = await client.post(f"{url}/v1/images/generations", headers={"Authorization": f"Bearer {key}"},
                          json={"prompt": prompt, "seed": seed, "num_inference_steps": steps})
    r.raise_for_status()
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
    return time.perf_counter() - start, image


def quantile(values, q):
    return float(np.quantile(np.asarray(values), q)) if values else None


async def capacity(url, a) -> float:
    """Saturated interactive requests per second (closed loop at the batch size)."""
    async with httpx.AsyncClient(timeout=3600) as client:
        count, clients = 4 * a.max_batch, a.max_batch
        start = time.perf_counter()

        async def worker(w):
            for i in range(w, count, clients):
                await generate(client, url, PRODUCT, "a red circle on a blue background", i,
                               a.interactive_steps)

        await asyncio.gather(*(worker(w) for w in range(clients)))
        return count / (time.perf_counter() - start)


async def alone(url, a) -> float:
    async with httpx.AsyncClient(timeout=3600) as client:
        times = [(await generate(client, url, PRODUCT, "a green square on a white background", i,
                                 a.interactive_steps))[0] for i in range(a.alone_requests)]
    return statistics.median(times)


async def mixed(url, a, rate: float, seed: int) -> dict:
    """The batch class saturating, interactive arrivals at ``rate`` for the same window."""
    rng = random.Random(seed)
    batch_images: dict[int, np.ndarray] = {}
    interactive: list[float] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=3600) as client:
        async def batch_worker(w):
            i = w
            while not stop.is_set():
                _, image = await generate(client, url, TRAINER, f"batch job {i}", 1000 + i,
                                          a.batch_steps)
                batch_images[i] = image
                i += a.batch_clients

        async def interactive_arrivals():
            tasks = []
            for i in range(a.interactive_requests):
                await asyncio.sleep(rng.expovariate(rate))
                tasks.append(asyncio.ensure_future(generate(
                    client, url, PRODUCT, f"interactive {i}", i, a.interactive_steps)))
            for t in tasks:
                interactive.append((await t)[0])

        workers = [asyncio.ensure_future(batch_worker(w)) for w in range(a.batch_clients)]
        await asyncio.sleep(2.0)  # the batch class saturates first
        start, done_before = time.perf_counter(), len(batch_images)
        await interactive_arrivals()
        window = time.perf_counter() - start
        batch_rate = (len(batch_images) - done_before) / window
        stop.set()
        await asyncio.gather(*workers)
    return {"interactive_p50_s": quantile(interactive, 0.5), "interactive_p99_s": quantile(interactive, 0.99),
            "batch_img_s": batch_rate, "batch_images": batch_images}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shapes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--interactive-steps", type=int, default=10)
    p.add_argument("--batch-steps", type=int, default=24)
    p.add_argument("--batch-clients", type=int, default=16)
    p.add_argument("--interactive-load", type=float, default=30.0)
    p.add_argument("--interactive-requests", type=int, default=60)
    p.add_argument("--alone-requests", type=int, default=10)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--aging", type=float, default=30.0)
    p.add_argument("--torch-threads", type=int, default=0)
    p.add_argument("--output-file", type=Path)
    a = p.parse_args(argv)
    rounds, checked = [], []
    for r in range(a.rounds):
        row = {}
        with server("fcfs", a) as srv:
            row["capacity_req_s"] = asyncio.run(capacity(srv.url, a))
            row["alone_s"] = asyncio.run(alone(srv.url, a))
            rate = row["capacity_req_s"] * a.interactive_load / 100
            row["fcfs"] = asyncio.run(mixed(srv.url, a, rate, r))
        with server("priority", a) as srv:
            row["priority"] = asyncio.run(mixed(srv.url, a, rate, r))
            metrics = httpx.get(srv.url + "/metrics").text
            row["preemptions"] = sum(float(line.split()[-1]) for line in metrics.splitlines()
                                     if line.startswith("diffserve_preemptions_total"))
        checked.append(row["priority"].pop("batch_images"))
        row["fcfs"].pop("batch_images")
        for policy in ("fcfs", "priority"):
            row[f"{policy} interactive p99 / alone"] = row[policy]["interactive_p99_s"] / row["alone_s"]
        row["batch img/s, priority / fcfs"] = row["priority"]["batch_img_s"] / row["fcfs"]["batch_img_s"]
        rounds.append(row)
        print(json.dumps({k: v for k, v in row.items()}, default=str), flush=True)
    from diffserve.executor.loading import load_model
    from helpers import make_request
    from reference import max_diff, solo

    loaded = load_model(a.model, torch_threads=a.torch_threads)
    worst, count = 0, 0
    for images in checked:
        for i, image in images.items():
            request = make_request(model=a.model, prompt=f"batch job {i}", seed=1000 + i,
                                   steps=a.batch_steps, width=image.shape[1], height=image.shape[0],
                                   guidance=loaded.defaults.get("guidance_scale", 5.0))
            worst, count = max(worst, max_diff(image, solo(loaded, {}, request)[0])), count + 1
    keys = ["fcfs interactive p99 / alone", "priority interactive p99 / alone",
            "batch img/s, priority / fcfs", "preemptions"]
    summary = {k: statistics.median(r[k] for r in rounds) for k in keys}
    summary.update(worst_pixel_diff=worst, images_checked=count, rounds=rounds)
    for k in keys:
        print(f"| {k} | {summary[k]:.3g} | {', '.join(f'{r[k]:.3g}' for r in rounds)} |")
    print(f"batch images checked against the pipeline alone: {count}, worst {worst}/255")
    if a.output_file:
        a.output_file.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0 if worst <= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
