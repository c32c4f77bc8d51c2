"""The set choice on a measured cost curve, with nothing else: which p50 each rule can reach at best.

A fake clock runs two sizes in turn in seeded Poisson arrivals through (1) request mode: the head's
size in a batch of at most ``--max-batch-size``, waiting ``--delay-ms`` for company while the head
is younger than that, a call costing one encoding, ``--steps`` forwards and one decoding; and (2)
step mode: every waiting request that fits the running cost joins at the next step, the step
advances the set that diffserve's own policy (``--set-policy``: :mod:`diffserve.policies`) picks,
a step with joins pays an encoding, one with leaves a decoding, and each step ``--step-host-ms``
(the engine's own work between forwards). Forward times are those of
``diffserve calibrate --json`` times ``--inflation`` (a served forward ÷ a calibrated one, from
/metrics). IPC and HTTP are left out.

    diffserve calibrate --model tiny-sd --sides 0.625,1 --batches 1,2,3,4,5,6,8 --steps 20 --json > cal.json
    python benchmarks/sets_model.py --calibration cal.json --sizes 64x64,40x40 --rate 28 --inflation 1.25
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from diffserve.policies import set_policy
from diffserve.policies.base import Member


class Curve:
    """Seconds per forward by size and image count, linear between the measured counts."""

    def __init__(self, report: dict, inflation: float) -> None:
        self.points: dict[str, dict[int, float]] = {}
        self.cost: dict[str, float] = {}
        for s in report["samples"]:
            size = f"{s['width']}x{s['height']}"
            self.points.setdefault(size, {})[s["image_count"]] = s["seconds"] * inflation
            self.cost[size] = s["cost"] / s["image_count"]

    def __call__(self, size: str, n: int) -> float:
        p = self.points[size]
        if n in p:
            return p[n]
        lo, hi = max(k for k in p if k < n), min(k for k in p if k > n)
        return p[lo] + (p[hi] - p[lo]) * (n - lo) / (hi - lo)


def request_mode(arrivals, curve, a) -> dict[str, list[float]]:
    t, queue, i, latency = 0.0, [], 0, {}
    while i < len(arrivals) or queue:
        while i < len(arrivals) and arrivals[i][0] <= t:
            queue.append(arrivals[i])
            i += 1
        if not queue:
            t = arrivals[i][0]
            continue
        head = queue[0]
        batch = [r for r in queue if r[1] == head[1]][:a.max_batch_size]
        if len(batch) < a.max_batch_size and t < head[0] + a.delay_ms / 1000:
            t = min(head[0] + a.delay_ms / 1000, arrivals[i][0] if i < len(arrivals) else float("inf"))
            continue
        for r in batch:
            queue.remove(r)
        t += (a.encode_ms + a.decode_ms) / 1000 + a.steps * curve(head[1], len(batch))
        for at, size in batch:
            latency.setdefault(size, []).append(t - at)
    return latency


def step_mode(arrivals, curve, a, policy) -> dict[str, list[float]]:
    t, queue, i, latency, running = 0.0, [], 0, {}, []  # running: (arrived, size, Member)
    while i < len(arrivals) or queue or running:
        while i < len(arrivals) and arrivals[i][0] <= t:
            queue.append(arrivals[i])
            i += 1
        used, joined = sum(curve.cost[size] for _, size, _ in running), False
        while queue and used + curve.cost[queue[0][1]] <= a.max_running_cost:
            at, size = queue.pop(0)
            running.append((at, size, Member(at, a.steps)))
            used, joined = used + curve.cost[size], True
        if not running:
            t = arrivals[i][0]
            continue
        sets: dict[str, list] = {}
        for r in running:
            sets.setdefault(r[1], []).append(r)
        size = policy.choose({k: [m for _, _, m in v] for k, v in sets.items()}, t)
        members = sorted(sets[size], key=lambda r: r[0])[:a.max_batch_size]
        dt = curve(size, len(members)) + (a.step_host_ms + (a.encode_ms if joined else 0.0)) / 1000
        t += dt
        for _, _, m in members:
            m.stepped(dt)
        if done := [r for r in members if not r[2].remaining]:
            t += a.decode_ms / 1000
            for r in done:
                running.remove(r)
                latency.setdefault(r[1], []).append(t - r[0])
    return latency


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[int(q * (len(values) - 1))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibration", type=Path, required=True)
    p.add_argument("--sizes", default="64x64,40x40")
    p.add_argument("--rate", type=float, required=True, help="requests/s, the sizes in turn")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--inflation", type=float, default=1.0)
    p.add_argument("--encode-ms", type=float, default=1.5)
    p.add_argument("--decode-ms", type=float, default=1.5)
    p.add_argument("--step-host-ms", type=float, default=0.0)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-running-cost", type=float, default=32.0)
    p.add_argument("--delay-ms", type=float, default=8.0)
    p.add_argument("--rules", default="oldest,fair,srpt,srpt:patience=1e9")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--requests", type=int, default=1000, help="per seed")
    a = p.parse_args(argv)
    curve, sizes = Curve(json.loads(a.calibration.read_text()), a.inflation), a.sizes.split(",")

    def pooled(run) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for seed in range(a.seeds):
            rng, t, arrivals = random.Random(seed), 0.0, []
            for n in range(a.requests):
                t += rng.expovariate(a.rate)
                arrivals.append((t, sizes[n % len(sizes)]))
            for size, values in run(arrivals).items():
                out.setdefault(size, []).extend(values)
        return out

    base = pooled(lambda arrivals: request_mode(arrivals, curve, a))
    print("request mode, p50 / p99 ms: " + ", ".join(
        f"{s} {1000 * quantile(base[s], .5):.0f} / {1000 * quantile(base[s], .99):.0f}" for s in sizes))
    for rule in a.rules.split(","):
        name, _, option = rule.partition(":")
        options = {k: float(v) for k, v in (option.split("="),)} if option else {}
        policy = set_policy(name, **options)
        got = pooled(lambda arrivals: step_mode(arrivals, curve, a, policy))
        print(f"{rule:>20}, ÷ request mode, p50 / p99: " + ", ".join(
            f"{s} {quantile(got[s], .5) / quantile(base[s], .5):.2f} / "
            f"{quantile(got[s], .99) / quantile(base[s], .99):.2f}" for s in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
