"""What the two batching modes can give, at best, for a measured cost curve.

A queueing simulation of the scheduler's rules with nothing but the denoiser's cost: seeded
Poisson arrivals, one executor, FIFO with the head never passed, ``--max-batch-size`` images at
most, ``--delay-ms`` for an idle executor. Request mode runs the head's group (same step count)
as one batch of ``steps x cost(B)``; step mode admits waiting requests at every step boundary
and each step costs ``cost(running images)``. Prompt encoding, VAE decoding, IPC and HTTP are
left out, so a served figure can only be worse; where it is close, the engine is at the bound
its cost curve allows. Loads are shares of request mode's saturated throughput, as in
``compare.py modes``.

    python benchmarks/queue_model.py --step-ms 1:15.1,2:18.9,4:25.1,8:42.2 --steps 20
    python benchmarks/queue_model.py --offline-json offline.json     # from bench_offline.py
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path

import kit


def cost_curve(points: dict[int, float]):
    """Seconds per denoiser step at n running images: piecewise linear through ``points``,
    extended linearly beyond them."""
    xs = sorted(points)
    if len(xs) == 1:
        return lambda n: points[xs[0]] * n / xs[0]

    def cost(n: int) -> float:
        i = max(1, min(len(xs) - 1, next((k for k, x in enumerate(xs) if x >= n), len(xs) - 1)))
        x0, x1 = xs[i - 1], xs[i]
        return points[x0] + (points[x1] - points[x0]) * (n - x0) / (x1 - x0)
    return cost


def arrivals(rate: float, count: int, seed: int, steps: list[int]) -> list[tuple[float, int]]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append((t, rng.choice(steps)))
    return out


def request_mode(jobs, cost, max_batch: int, delay: float) -> list[float]:
    """Latency of each job (in arrival order): batches of the head's step count."""
    latency, waiting, t, i = [0.0] * len(jobs), [], 0.0, 0
    while i < len(jobs) or waiting:
        while i < len(jobs) and jobs[i][0] <= t:
            waiting.append(i)
            i += 1
        if not waiting:
            t = jobs[i][0]
            continue
        steps = jobs[waiting[0]][1]
        group = [j for j in waiting if jobs[j][1] == steps][:max_batch]
        ready_at = jobs[waiting[0]][0] + delay
        if len(group) < max_batch and t < ready_at:
            t = min(ready_at, jobs[i][0]) if i < len(jobs) else ready_at
            continue
        t += steps * cost(len(group))
        for j in group:
            latency[j] = t - jobs[j][0]
        taken = set(group)
        waiting = [j for j in waiting if j not in taken]
    return latency


def step_mode(jobs, cost, max_batch: int, delay: float) -> list[float]:
    """Latency of each job: join at a step boundary, leave when its own steps are done."""
    latency, waiting, running, t, i = [0.0] * len(jobs), [], {}, 0.0, 0
    while i < len(jobs) or waiting or running:
        while i < len(jobs) and jobs[i][0] <= t:
            waiting.append(i)
            i += 1
        if not running:
            if not waiting:
                t = jobs[i][0]
                continue
            ready_at = jobs[waiting[0]][0] + delay
            if len(waiting) < max_batch and t < ready_at:
                t = min(ready_at, jobs[i][0]) if i < len(jobs) else ready_at
                continue
        room = max_batch - len(running)
        running.update((j, jobs[j][1]) for j in waiting[:room])
        waiting = waiting[room:]
        t += cost(len(running))
        for j in list(running):
            running[j] -= 1
            if running[j] == 0:
                latency[j] = t - jobs[j][0]
                del running[j]
    return latency


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    p = kit.parser(__doc__, max_batch_size=8, output_file=None)
    p.add_argument("--step-ms", help="cost per denoiser step: 'images:ms,...' (e.g. 1:15,8:42)")
    p.add_argument("--offline-json", type=Path, help="bench_offline.py --output-file report to "
                   "take the curve from (its median per batch over its step count)")
    p.add_argument("--steps", type=int, help="steps per request (default: the JSON's, else 20)")
    p.add_argument("--mixed-steps", type=kit.ints, default=[8, 32], help="step counts mixed at half load")
    p.add_argument("--loads", type=kit.floats, default=[25, 50, 80, 90], help="percent of request mode's saturation")
    p.add_argument("--step-max-batch-size", type=int,
                   help="bound of step mode's running set, if not --max-batch-size")
    p.add_argument("--delay-ms", type=float, default=8.0)
    p.add_argument("--requests", type=int, default=2000, help="per seed")
    p.add_argument("--seeds", type=int, default=10)
    a = p.parse_args(argv)
    if bool(a.step_ms) == bool(a.offline_json):
        p.error("give one of --step-ms and --offline-json")
    steps = a.steps
    if a.offline_json:
        report = json.loads(a.offline_json.read_text())
        steps = steps or report["num_inference_steps"]
        points = {r["batch_size"]: r["median_s"] / report["num_inference_steps"] for r in report["results"]}
    else:
        points = {int(n): float(ms) / 1000 for n, ms in (pair.split(":") for pair in a.step_ms.split(","))}
    steps = steps or 20
    if min(points) < 1 or min(points.values()) <= 0 or a.requests < 1 or min(
            a.max_batch_size, a.step_max_batch_size or 1) < 1:
        p.error("batch sizes, costs, bounds and --requests must be positive")
    cost, delay = cost_curve(points), a.delay_ms / 1000
    saturated = a.max_batch_size / (steps * cost(a.max_batch_size))
    mix = a.mixed_steps

    def run(rate: float, step_counts: list[int]):
        req, stp, kinds = [], [], []
        for seed in range(a.seeds):
            jobs = arrivals(rate, a.requests, seed, step_counts)
            req += request_mode(jobs, cost, a.max_batch_size, delay)
            stp += step_mode(jobs, cost, a.step_max_batch_size or a.max_batch_size, delay)
            kinds += [s for _, s in jobs]
        return req, stp, kinds

    out = {"steps": steps, "cost_ms": {n: 1000 * c for n, c in sorted(points.items())},
           "max_batch_size": a.max_batch_size,
           "step_max_batch_size": a.step_max_batch_size or a.max_batch_size, "delay_ms": a.delay_ms,
           "saturated_req_s": saturated, "loads": {}}
    print(f"cost per step (ms): {', '.join(f'{n}: {1000 * c:.1f}' for n, c in sorted(points.items()))}; "
          f"{steps} steps; request mode saturates at {saturated:.2f} req/s")
    print("| load | request p50 / p99 ms | step p50 / p99 ms | step/request p50 | p99 |")
    print("| --- | --- | --- | --- | --- |")
    for load in a.loads:
        req, stp, _ = run(load / 100 * saturated, [steps])
        row = {"request_p50_s": quantile(req, 0.5), "request_p99_s": quantile(req, 0.99),
               "step_p50_s": quantile(stp, 0.5), "step_p99_s": quantile(stp, 0.99)}
        row["p50_ratio"] = row["step_p50_s"] / row["request_p50_s"]
        row["p99_ratio"] = row["step_p99_s"] / row["request_p99_s"]
        out["loads"][f"{load:g}"] = row
        print(f"| {load:g}% | {1000 * row['request_p50_s']:.0f} / {1000 * row['request_p99_s']:.0f} | "
              f"{1000 * row['step_p50_s']:.0f} / {1000 * row['step_p99_s']:.0f} | "
              f"{row['p50_ratio']:.2f} | {row['p99_ratio']:.2f} |")
    req, stp, kinds = run(0.5 * saturated * steps / statistics.mean(mix), mix)
    short = min(mix)
    means = [statistics.mean(x for x, k in zip(lat, kinds) if k == short) for lat in (req, stp)]
    out["mixed"] = {"steps": mix, "short_mean_request_s": means[0], "short_mean_step_s": means[1],
                    "ratio": means[1] / means[0]}
    print(f"mixed {','.join(map(str, mix))} at half load: {short}-step mean {1000 * means[0]:.0f} ms (request) "
          f"against {1000 * means[1]:.0f} ms (step), step/request {means[1] / means[0]:.2f}")
    kit.write_json(a.output_file, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
