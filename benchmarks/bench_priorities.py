"""Interactive and batch classes on one server, under ``--scheduling-policy fcfs`` and ``priority``:
interactive Poisson arrivals (class 0) beside a saturating batch class (class 10); the interactive
p99 against its latency alone, the batch class's images/s, its images against the pipeline alone.

    python benchmarks/bench_priorities.py --model shapes --rounds 3 --output-file priorities.json
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

import numpy as np

from kit import cli, in_process, loadgen, server_metrics, servers
from diffserve.work import ImageRequest

PRODUCT, TRAINER = "product-key", "trainer-key"
BEARER = {key: {"Authorization": f"Bearer {key}"} for key in (PRODUCT, TRAINER)}
TARGETS = [("priority interactive p99 / alone", "<=", 1.5), ("batch img/s, priority / fcfs", ">=", 0.9)]


async def generate(client, url, key, prompt, seed, steps) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    image = await loadgen.image(client, url, {"prompt": prompt, "seed": seed, "num_inference_steps": steps},
                            headers=BEARER[key])
    return time.perf_counter() - start, image


async def mixed(url, a, rate: float, seed: int) -> tuple[dict, dict[int, np.ndarray]]:
    """The batch class saturating, interactive arrivals at ``rate`` meanwhile: figures, batch images."""
    images, stop = {}, asyncio.Event()
    async with loadgen.session() as client:
        async def batch_client(i):
            while not stop.is_set():
                images[i] = (await generate(client, url, TRAINER, f"batch job {i}", 1000 + i, a.batch_steps))[1]
                i += a.batch_clients

        clients = [asyncio.ensure_future(batch_client(c)) for c in range(a.batch_clients)]
        await asyncio.sleep(a.settle_s)  # the batch class saturates first
        start, done_before = time.perf_counter(), len(images)
        interactive = [t for t, _ in await loadgen.drive(
            lambda i: generate(client, url, PRODUCT, f"interactive {i}", i, a.interactive_steps),
            a.interactive_requests, rate, rng=random.Random(seed))]
        batch_rate = (len(images) - done_before) / (time.perf_counter() - start)
        stop.set()
        await asyncio.gather(*clients)
    return {"interactive p50 s": float(np.quantile(interactive, 0.5)),
            "interactive p99 s": float(np.quantile(interactive, 0.99)), "batch img/s": batch_rate}, images


def priorities(b: servers.Bench) -> dict[str, float | None]:
    a, f = b.args, {}
    for policy in ("fcfs", "priority"):
        trainer = f"{TRAINER}:10" if policy == "priority" else TRAINER
        with b.servers(policy, {"--scheduling-policy": policy, "--priority-aging-s": a.aging,
                                "--api-key": [PRODUCT, trainer], "--max-inference-steps": 1000}) as served:
            url, interactive = served.urls[0], {"steps": a.interactive_steps, "headers": BEARER[PRODUCT]}
            if policy == "fcfs":  # the interactive class alone: its capacity (closed loop) and latency
                f["capacity req/s"] = b.load(served, "interactive capacity", num_prompts=4 * a.max_batch_size,
                                             max_concurrency=a.max_batch_size, **interactive)["requests_per_s"]
                f["alone s"] = b.load(served, "interactive alone", num_prompts=a.alone_requests, max_concurrency=1,
                                      **interactive)["latency_s"]["p50"]
            figures, images = asyncio.run(mixed(url, a, f["capacity req/s"] * a.interactive_load / 100, b.round - 1))
            if policy == "priority":
                samples = server_metrics.metrics(url)
                f["preemptions"] = server_metrics.total(samples, "diffserve_preemptions_total") or 0.0
        f.update({f"{k}, {policy}": v for k, v in figures.items()})
        f[f"{policy} interactive p99 / alone"] = figures["interactive p99 s"] / f["alone s"]
    f["batch img/s, priority / fcfs"] = f["batch img/s, priority"] / f["batch img/s, fcfs"]
    ref = in_process.reference(a.model, a.torch_threads)
    guidance = ref.loaded.defaults.get("guidance_scale", 5.0)
    diffs = [ref.diff(image, ref.images(ImageRequest(
        "ref", a.model, image.shape[1], image.shape[0], num_inference_steps=a.batch_steps, guidance_scale=guidance,
        prompt=f"batch job {i}", seed=1000 + i))[0]) for i, image in images.items()]  # the priority server's
    f["images checked"], f["worst pixel diff"] = len(diffs), max(diffs, default=0)
    b.failed |= f["worst pixel diff"] > 2
    return f


def arguments(p) -> None:
    p.add_argument("--interactive-steps", type=int, default=10)
    p.add_argument("--batch-steps", type=int, default=24)
    p.add_argument("--batch-clients", type=cli.count, default=16)
    p.add_argument("--interactive-load", type=float, default=30.0, help="%% of the interactive capacity.")
    p.add_argument("--interactive-requests", type=cli.count, default=60)
    p.add_argument("--alone-requests", type=cli.count, default=10)
    p.add_argument("--aging", type=float, default=30.0, help="The servers' --priority-aging-s.")
    p.add_argument("--settle-s", type=float, default=2.0, help="The batch class alone first, s.")


def main(argv: list[str] | None = None) -> int:
    return servers.main(__doc__, {"priorities": servers.Scenario(priorities, TARGETS)}, argv, arguments,
                        model="shapes", rounds=3, max_batch_size=8, torch_threads=0)


if __name__ == "__main__":
    sys.exit(main())
