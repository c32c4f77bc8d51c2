"""What the two batching modes can give with two image sizes, at best, for measured cost curves.

A simulation of ``compare.py sizes`` with nothing but the denoiser's cost: the server's own
:class:`~diffserve.scheduler.core.SchedulerCore` (queue, admission by images and cost, the head
rule) and the step engine's own set policy (:mod:`diffserve.policies`, ``--set-policy``) run
on a fake clock, with an executor whose forward costs what ``diffserve calibrate --json`` measured
for each size and image count. Prompt encoding, VAE decoding, IPC and HTTP are left out, so a
served figure can only be worse; where it is close, the engine is at the bound its curves allow.

    diffserve calibrate --model shapes --sides 1,1.5 --batches 1,2,3,4,6,8 --json > cal.json
    python benchmarks/sizes_model.py --calibration cal.json --sizes 32x32,48x48 --steps 20
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from queue_model import cost_curve, quantile  # noqa: E402

from diffserve.costs import default_bounds  # noqa: E402
from diffserve.policies import SET_POLICIES, set_policy  # noqa: E402
from diffserve.policies.base import Member  # noqa: E402
from diffserve.protocol import REQUEST_MODE, STEP_MODE, ImageRequest, ItemResult, ItemsDone  # noqa: E402
from diffserve.scheduler.core import SchedulerCore  # noqa: E402


@dataclass
class Model:
    """The measured machine: seconds per step by size and image count, the cost of one image
    of each size, and the server's bounds."""

    curves: dict[str, object]
    image_cost: dict[str, float]
    steps: int
    max_batch_size: int = 8
    max_batch_cost: float = 16.0
    max_running_cost: float = 32.0
    delay_s: float = 0.008
    set_policy: str = "fair"


@dataclass
class _Unit:
    item: object
    size: str
    left: int
    member: Member


@dataclass
class Run:
    latency: dict[str, list[float]] = field(default_factory=dict)  # size -> seconds
    forwards: list[int] = field(default_factory=list)  # images per forward
    seconds: float = 0.0
    completed: int = 0


def simulate(model: Model, mode: str, arrivals=None, clients: int = 0, sizes=(), count: int = 0) -> Run:
    """Open loop (``arrivals``: [(time, size)]) or closed loop (``clients`` in flight, ``count``
    requests in all, sizes in turn). One executor."""
    core = SchedulerCore(model.max_batch_size, model.delay_s, 1, mode=mode,
                         max_batch_cost=model.max_batch_cost, max_running_cost=model.max_running_cost)
    core.executor_ready(0, 0.0)
    choose = set_policy(model.set_policy).choose
    run, t, ids = Run(), 0.0, itertools.count()
    born: dict[str, tuple[float, str]] = {}
    pending = list(arrivals or [])
    pending.reverse()  # pop() from the end: the earliest first
    sent = 0

    def submit(at: float, size: str) -> None:
        rid = f"r{next(ids)}"
        w, h = (int(v) for v in size.split("x"))
        born[rid] = (at, size)
        core.add(ImageRequest(request_id=rid, model="model", width=w, height=h,
                              num_inference_steps=model.steps, cost=model.image_cost[size]), [], at)

    for _ in range(clients):
        submit(0.0, sizes[sent % len(sizes)])
        sent += 1
    units: list[_Unit] = []

    def finish(unit_items, now) -> None:
        nonlocal sent
        done = ItemsDone([ItemResult(i.request.request_id, i.start, i.stop, "finished", 0.0)
                          for i in unit_items])
        for f in core.complete(0, done, now):
            rid = f.done.request_id
            at, size = born.pop(rid)
            run.latency.setdefault(size, []).append(now - at)
            run.completed += 1
            if clients and sent < count:
                submit(now, sizes[sent % len(sizes)])
                sent += 1

    while pending or born:
        while pending and pending[-1][0] <= t:
            at, size = pending.pop()
            submit(at, size)
        for d in core.dispatch(t):
            for item in d.work.items:
                w, h = item.request.width, item.request.height
                units.append(_Unit(item, f"{w}x{h}", model.steps,
                                   Member(t - item.queued_s, model.steps)))
        if not units:
            wait = core.time_until_dispatch(t)
            nxt = [x for x in (pending[-1][0] if pending else None,
                               t + wait if wait is not None else None) if x is not None]
            if not nxt:
                break
            t = max(t, min(nxt)) if min(nxt) > t else t + 1e-6
            continue
        if mode == REQUEST_MODE:  # the whole batch, as one pipeline call
            size, n = units[0].size, sum(u.item.stop - u.item.start for u in units)
            t += model.steps * model.curves[size](n)
            run.forwards += [n] * model.steps
            finish([u.item for u in units], t)
            units = []
            continue
        sets: dict[str, list[_Unit]] = {}
        for u in units:
            sets.setdefault(u.size, []).append(u)
        size = choose({k: [u.member for u in v] for k, v in sets.items()}, t)
        chosen = sets[size]
        n = sum(u.item.stop - u.item.start for u in chosen)
        dt = model.curves[size](n)
        t += dt
        run.forwards.append(n)
        for u in chosen:
            u.left -= 1
            u.member.stepped(dt)
        ended = [u for u in chosen if u.left == 0]
        units = [u for u in units if u.left > 0]
        if ended:
            finish([u.item for u in ended], t)
    run.seconds = t
    return run


def poisson(rate: float, count: int, seed: int, sizes, weights=None):
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(count):
        t += rng.expovariate(rate)
        out.append((t, rng.choices(sizes, weights)[0] if weights else sizes[i % len(sizes)]))
    return out


def figures(model: Model, sizes: list[str], load: float, requests: int, seeds: int,
            clients: int) -> dict[str, float]:
    """compare.py sizes' figures, as the model gives them."""
    f: dict[str, float] = {}
    saturated = {}
    for mode in (REQUEST_MODE, STEP_MODE):
        r = simulate(model, mode, clients=clients, sizes=sizes, count=requests)
        saturated[mode] = r.completed / r.seconds
        f[f"saturated req/s mixed, {mode}"] = saturated[mode]
    f["saturated img/s mixed, step / request"] = saturated[STEP_MODE] / saturated[REQUEST_MODE]
    rate = saturated[REQUEST_MODE] * load / 100

    def lat(mode, arrivals_of, size=None):
        values, per_forward = [], []
        for seed in range(seeds):
            r = simulate(model, mode, arrivals_of(seed))
            values += [x for s, xs in r.latency.items() if size in (None, s) for x in xs]
            per_forward += r.forwards
        return values, sum(per_forward) / len(per_forward)

    uniform = []
    for i, size in enumerate(sizes, 1):
        for mode in (REQUEST_MODE, STEP_MODE):
            values, _ = lat(mode, lambda s: poisson(rate, requests, s, sizes), size)
            f[f"p50 ms size {i}, {mode}"] = 1000 * quantile(values, 0.5)
            f[f"p99 ms size {i}, {mode}"] = 1000 * quantile(values, 0.99)
        alone, _ = lat(STEP_MODE, lambda s: poisson(rate / 2, requests // 2, s, [size]))
        f[f"p99 ms size {i} alone (half the rate)"] = 1000 * quantile(alone, 0.99)
        only, per_forward = lat(STEP_MODE, lambda s: poisson(rate, requests, s, [size]))
        f[f"p99 ms size {i} only (the same rate)"] = 1000 * quantile(only, 0.99)
        uniform.append(per_forward)
        f[f"p99 size {i}, mixed / alone"] = f[f"p99 ms size {i}, step"] / f[f"p99 ms size {i} alone (half the rate)"]
        f[f"p99 size {i}, mixed / only"] = f[f"p99 ms size {i}, step"] / f[f"p99 ms size {i} only (the same rate)"]
        f[f"p50 size {i}, step / request"] = f[f"p50 ms size {i}, step"] / f[f"p50 ms size {i}, request"]
    _, mixed_per_forward = lat(STEP_MODE, lambda s: poisson(rate, requests, s, sizes))
    f["images per forward, mixed / uniform"] = mixed_per_forward / (sum(uniform) / len(uniform))
    rare, _ = lat(STEP_MODE, lambda s: poisson(rate, requests, s, sizes, [9, 1]), sizes[1])
    rare_alone, _ = lat(STEP_MODE, lambda s: poisson(rate / 10, max(8, requests // 4), s, [sizes[1]]))
    f["p99 rare size (90/10), mixed / alone"] = quantile(rare, 0.99) / quantile(rare_alone, 0.99)
    return f


def load_model(path: Path, sizes: list[str], steps: int, max_batch_size: int, max_batch_cost: float,
               max_running_cost: float, policy: str = "fair") -> Model:
    report = json.loads(path.read_text())
    points: dict[str, dict[int, float]] = {}
    cost: dict[str, float] = {}
    for s in report["samples"]:
        size = f"{s['width']}x{s['height']}"
        points.setdefault(size, {})[s["image_count"]] = s["seconds"]
        cost[size] = s["cost"] / s["image_count"]
    missing = [s for s in sizes if s not in points]
    if missing:
        raise SystemExit(f"the calibration has no points for {missing} (it has {sorted(points)})")
    batch, running = default_bounds(max_batch_size, max_batch_cost, max_running_cost,
                                    report["facts"]["native_image_cost"])
    return Model({s: cost_curve(points[s]) for s in sizes}, {s: cost[s] for s in sizes}, steps,
                 max_batch_size, batch, running, set_policy=policy)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibration", type=Path, required=True, help="diffserve calibrate --json output")
    p.add_argument("--sizes", required=True, help='two sizes, e.g. "32x32,48x48"')
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--load", type=float, default=60, help="%% of request mode's saturated rate")
    p.add_argument("--requests", type=int, default=1000, help="per seed")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--clients", type=int, default=32, help="closed loop, for saturation")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-batch-cost", type=float, default=0.0, help="0: the server's default")
    p.add_argument("--max-running-cost", type=float, default=0.0, help="0: the server's default")
    p.add_argument("--set-policy", choices=tuple(SET_POLICIES), default="fair",
                   help="the step engine's choice of running set")
    p.add_argument("--output-file", type=Path)
    a = p.parse_args(argv)
    sizes = [s.strip() for s in a.sizes.split(",")]
    if len(sizes) != 2 or min(a.steps, a.requests, a.seeds, a.clients) < 1:
        p.error("two sizes, and positive counts")
    model = load_model(a.calibration, sizes, a.steps, a.max_batch_size, a.max_batch_cost,
                       a.max_running_cost, a.set_policy)
    f = figures(model, sizes, a.load, a.requests, a.seeds, a.clients)
    print(f"model: {', '.join(sizes)}, {a.steps} steps, load {a.load:g}%, {a.set_policy} sets, forward cost "
          f"<= {model.max_batch_cost:g}, running <= {model.max_running_cost:g}")
    for name, value in f.items():
        print(f"| {name} | {value:.3g} |")
    if a.output_file:
        a.output_file.write_text(json.dumps(f, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
