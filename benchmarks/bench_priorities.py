"""Interactive and batch classes on one server: a saturating batch class (``--batch-steps``
steps, closed loop of ``--batch-clients``, its API key at class 10) beside an interactive class
(``--interactive-steps`` steps, class 0, Poisson arrivals at ``--interactive-load`` percent of
the interactive capacity), under ``--scheduling-policy fcfs`` and ``priority``, one server each,
in ``--rounds`` rounds (fresh servers each).

Per round: the interactive capacity (saturated req/s of interactive requests alone, fcfs server),
the interactive latency alone (idle server, median), then the mixed load on each server: the
interactive p50/p99 and the batch class's images/s. Every batch image of the priority server
(some of them paused and resumed) is checked against the plain pipeline alone.

    python benchmarks/bench_priorities.py --model shapes --rounds 3 --output-file priorities.json
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time

import aiohttp
import numpy as np

import kit
from diffserve.protocol import ImageRequest

PRODUCT, TRAINER = "product-key", "trainer-key"
TARGETS = [("priority interactive p99 / alone", "<=", 1.5), ("batch img/s, priority / fcfs", ">=", 0.9)]


async def generate(client, url, key, prompt, seed, steps) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    async with client.post(url + kit.ENDPOINT, headers={"Authorization": f"Bearer {key}"}, raise_for_status=True,
                           json={"prompt": prompt, "seed": seed, "num_inference_steps": steps}) as r:
        image = kit.decode((await r.json())["data"][0]["b64_json"])
    return time.perf_counter() - start, image


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))


async def capacity(url, a) -> float:
    """Saturated interactive requests per second (closed loop at the batch size)."""
    async with session() as client:
        count, start = 4 * a.max_batch_size, time.perf_counter()
        await kit.drive(lambda i: generate(client, url, PRODUCT, "a red circle on a blue background", i,
                                           a.interactive_steps), count, concurrency=a.max_batch_size)
        return count / (time.perf_counter() - start)


async def alone(url, a) -> float:
    async with session() as client:
        return statistics.median([(await generate(client, url, PRODUCT, "a green square on a white background",
                                                  i, a.interactive_steps))[0] for i in range(a.alone_requests)])


async def mixed(url, a, rate: float, seed: int) -> dict:
    """The batch class saturating, interactive arrivals at ``rate`` for the same window."""
    batch_images: dict[int, np.ndarray] = {}
    stop = asyncio.Event()
    async with session() as client:
        async def batch_worker(i):
            while not stop.is_set():
                batch_images[i] = (await generate(client, url, TRAINER, f"batch job {i}", 1000 + i,
                                                  a.batch_steps))[1]
                i += a.batch_clients

        workers = [asyncio.ensure_future(batch_worker(w)) for w in range(a.batch_clients)]
        await asyncio.sleep(a.settle_s)  # the batch class saturates first
        start, done_before = time.perf_counter(), len(batch_images)
        interactive = [t for t, _ in await kit.drive(
            lambda i: generate(client, url, PRODUCT, f"interactive {i}", i, a.interactive_steps),
            a.interactive_requests, rate, rng=random.Random(seed))]
        batch_rate = (len(batch_images) - done_before) / (time.perf_counter() - start)
        stop.set()
        await asyncio.gather(*workers)
    return {"interactive p50 s": float(np.quantile(interactive, 0.5)),
            "interactive p99 s": float(np.quantile(interactive, 0.99)),
            "batch img/s": batch_rate, "images": batch_images}


def priorities(b: kit.Bench) -> dict[str, float | None]:
    a, f, run = b.args, {}, {}
    for policy in ("fcfs", "priority"):
        trainer = f"{TRAINER}:10" if policy == "priority" else TRAINER
        with b.servers(policy, {"--scheduling-policy": policy, "--priority-aging-s": a.aging,
                                "--api-key": [PRODUCT, trainer], "--max-inference-steps": 1000}) as served:
            url = served.urls[0]
            if policy == "fcfs":
                f["capacity req/s"] = asyncio.run(capacity(url, a))
                f["alone s"] = asyncio.run(alone(url, a))
            run[policy] = asyncio.run(mixed(url, a, f["capacity req/s"] * a.interactive_load / 100, b.round - 1))
            if policy == "priority":
                f["preemptions"] = kit.total(kit.metrics(url), "diffserve_preemptions_total") or 0.0
        f.update({f"{k}, {policy}": v for k, v in run[policy].items() if k != "images"})
        f[f"{policy} interactive p99 / alone"] = run[policy]["interactive p99 s"] / f["alone s"]
    f["batch img/s, priority / fcfs"] = f["batch img/s, priority"] / f["batch img/s, fcfs"]
    ref = kit.reference(a.model, a.torch_threads)
    diffs = [ref.diff(image, ref.images(ImageRequest(
        "ref", a.model, image.shape[1], image.shape[0], num_inference_steps=a.batch_steps,
        guidance_scale=ref.guidance(5.0), prompt=f"batch job {i}", seed=1000 + i))[0])
        for i, image in run["priority"]["images"].items()]
    f["images checked"], f["worst pixel diff"] = len(diffs), max(diffs, default=0)
    b.failed |= f["worst pixel diff"] > 2
    return f


def priorities_args(p) -> None:
    p.add_argument("--interactive-steps", type=int, default=10)
    p.add_argument("--batch-steps", type=int, default=24)
    p.add_argument("--batch-clients", type=int, default=16)
    p.add_argument("--interactive-load", type=float, default=30.0, help="%% of the interactive capacity.")
    p.add_argument("--interactive-requests", type=int, default=60)
    p.add_argument("--alone-requests", type=int, default=10)
    p.add_argument("--aging", type=float, default=30.0, help="The servers' --priority-aging-s.")
    p.add_argument("--settle-s", type=float, default=2.0, help="The batch class alone first, s.")


if __name__ == "__main__":
    sys.exit(kit.main(__doc__, {"priorities": kit.Scenario(priorities, TARGETS, priorities_args)},
                      model="shapes", rounds=3, max_batch_size=8, torch_threads=0))
