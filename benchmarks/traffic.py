"""compare.py's scenarios of heterogeneous traffic: LoRA adapters, mixed sizes and rollouts."""

from __future__ import annotations

import asyncio
import statistics
import time

import kit
from kit import Bench, Scenario, ms, ratio


def lora(b: Bench) -> dict[str, float | None]:
    """Requests spread evenly over k distinct LoRA adapters (``--lora-counts``, 0 = none), random
    adapters of each rank in ``--lora-ranks`` written offline (``tools/loras.py``). Step mode:
    saturated img/s (closed loop at ``--concurrency``) for every k, and p99 under Poisson arrivals
    at ``--lora-load`` percent of the saturated rate without adapters, with none and with the most
    adapters; request mode (one stack per call) saturated with the most adapters."""
    from tools.loras import write_lora

    a, f = b.args, {}
    most = max(a.lora_counts)
    for rank in a.lora_ranks:
        root = b.out_dir / "loras" / f"r{rank}"
        names = [f"L{i}" for i in range(most)]
        for i, name in enumerate(names):
            if not (root / name).exists():
                write_lora(a.model, root / name, rank=rank, seed=i, weight_scale=0.2)
        served = {"--lora-modules": [f"{n}={root / n}" for n in names],
                  "--max-loras": max(most, 4), "--max-lora-rank": rank}
        tag = f"rank {rank}"
        with b.servers(f"step, {tag}", {"--batching-mode": "step", **served}) as servers:
            for k in a.lora_counts:
                models = names[:k] or None
                sat = b.load(servers, f"step k={k} {tag} saturated", max_concurrency=a.concurrency,
                             models=models)
                f[f"saturated img/s, {k} adapters, step, {tag}"] = sat["images_per_s"]
                if k == 0:
                    rate = sat["requests_per_s"] * a.lora_load / 100
                if k in (0, most):
                    lat = b.load(servers, f"step k={k} {tag} @{a.lora_load}%", request_rate=rate,
                                 models=models)["latency_s"]
                    f[f"p99 ms @{a.lora_load}%, {k} adapters, {tag}"] = ms(lat["p99"])
        with b.servers(f"request, {tag}", {"--batching-mode": "request", **served}) as servers:
            sat = b.load(servers, f"request k={most} {tag} saturated", max_concurrency=a.concurrency,
                         models=names)
            f[f"saturated img/s, {most} adapters, request, {tag}"] = sat["images_per_s"]
        step = lambda k: f.get(f"saturated img/s, {k} adapters, step, {tag}")  # noqa: E731
        f[f"saturated img/s, {most} adapters / none, {tag}"] = ratio(step(most), step(0))
        f[f"saturated img/s, {most} adapters, step/request, {tag}"] = ratio(
            step(most), f[f"saturated img/s, {most} adapters, request, {tag}"])
        f[f"p99 @{a.lora_load}%, {most} adapters / none, {tag}"] = ratio(
            f.get(f"p99 ms @{a.lora_load}%, {most} adapters, {tag}"),
            f.get(f"p99 ms @{a.lora_load}%, 0 adapters, {tag}"))
    return f


def lora_args(p) -> None:
    p.add_argument("--lora-counts", type=kit.ints, default=[0, 1, 4, 16], help="lora: distinct adapters.")
    p.add_argument("--lora-ranks", type=kit.ints, default=[8, 64], help="lora: adapter ranks.")
    p.add_argument("--lora-load", type=int, default=70, help="lora: %% of saturation for the p99.")


def sizes(b: Bench) -> dict[str, float | None]:
    """Two sizes (``--sizes``; "size 1" and "size 2" in order, "rare" is size 2), Poisson arrivals
    at ``--sizes-load`` percent of request mode's saturated rate with the sizes alternating
    (seeded), in request mode and in step mode: each size's p50 and p99; in step mode also each
    size's arrivals alone (half the rate), one size only at the full rate (images per forward), a
    90/10 mix with the rare size's arrivals alone; and the saturated throughput with mixed sizes."""
    a, f = b.args, {}
    if len(a.sizes or []) != 2:
        raise SystemExit("compare.py sizes: needs --sizes with two sizes, e.g. 32x32,48x48")
    both, second = a.sizes, a.sizes[1]
    per_image = lambda run: (run["server_metrics"] or {}).get("mean_step_running_images")  # noqa: E731
    rate = None
    for name in ("request", "step"):  # request first: its saturation sets the offered load
        with b.servers(name, {"--batching-mode": name}) as served:
            sat = b.load(served, f"{name} saturated mixed", max_concurrency=a.concurrency, sizes=both)
            f[f"saturated img/s mixed, {name}"] = sat["images_per_s"]
            rate = rate or sat["requests_per_s"] * a.sizes_load / 100
            mixed = b.load(served, f"{name} mixed @{a.sizes_load}%", request_rate=rate, sizes=both)
            for i, size in enumerate(both, 1):
                lat = mixed["latency_by_size_s"][size]
                f[f"p50 ms size {i} ({size}), {name}"] = ms(lat["p50"])
                f[f"p99 ms size {i} ({size}), {name}"] = ms(lat["p99"])
            f[f"images per forward mixed, {name}"] = per_image(mixed)
            if name != "step":
                continue
            uniform = []
            for i, size in enumerate(both, 1):
                alone = b.load(served, f"{name} {size} alone", request_rate=rate / 2, sizes=[size],
                               num_prompts=a.num_requests // 2)
                f[f"p99 ms size {i} ({size}) alone"] = ms(alone["latency_s"]["p99"])
                full = b.load(served, f"{name} {size} only", request_rate=rate, sizes=[size])
                uniform.append(per_image(full))
            f["images per forward, uniform"] = None if None in uniform else sum(uniform) / len(uniform)
            rare = b.load(served, f"{name} 90/10", request_rate=rate, sizes=both, size_weights=[9, 1])
            f["p99 ms rare (90/10)"] = ms(rare["latency_by_size_s"][second]["p99"])
            rare_alone = b.load(served, f"{name} rare alone", request_rate=rate / 10, sizes=[second],
                                num_prompts=max(8, a.num_requests // 4))
            f["p99 ms rare alone"] = ms(rare_alone["latency_s"]["p99"])
    for i, size in enumerate(both, 1):
        f[f"p99 size {i}, mixed / alone"] = ratio(f.get(f"p99 ms size {i} ({size}), step"),
                                                  f.get(f"p99 ms size {i} ({size}) alone"))
        f[f"p50 size {i}, step / request"] = ratio(f.get(f"p50 ms size {i} ({size}), step"),
                                                   f.get(f"p50 ms size {i} ({size}), request"))
    f["images per forward, mixed / uniform"] = ratio(f.get("images per forward mixed, step"),
                                                     f.get("images per forward, uniform"))
    f["p99 rare size (90/10), mixed / alone"] = ratio(f.get("p99 ms rare (90/10)"), f.get("p99 ms rare alone"))
    f["saturated img/s mixed, step / request"] = ratio(f.get("saturated img/s mixed, step"),
                                                       f.get("saturated img/s mixed, request"))
    return f


def sizes_args(p) -> None:
    p.add_argument("--sizes", type=kit.names, default=None,
                   help='sizes: the two sizes to mix, e.g. "32x32,48x48" (required).')
    p.add_argument("--sizes-load", type=int, default=60, help="sizes: %% of request mode's saturation.")


ROLLOUT_PROMPTS = ["a red circle", "a blue square", "a green triangle", "a yellow star",
                   "an orange ring", "a purple cross", "a white disc", "a black bar"]


def rollout(b: Bench) -> dict[str, float | None]:
    """``POST /v1/rollouts`` on a flow-matching model: ``--rollout-prompts`` prompts x
    ``--rollout-n`` samples sent all at once as one request per prompt (step mode, request mode)
    and as single requests of one sample each with the seeds the group would use (step mode).
    Per layout: samples/s (median of ``--rollout-repeats``) and the time to the last sample of a
    group (mean over groups). One server per mode; each layout on it has a warm-up of its own."""
    a, f = b.args, {}
    prompts = ROLLOUT_PROMPTS[:a.rollout_prompts]
    common = {**({"num_inference_steps": a.steps} if a.steps else {}), **({"size": a.size} if a.size else {})}
    layouts = {"groups": lambda seed: [[{"prompt": p, "n": a.rollout_n, "seed": seed + g * a.rollout_n,
                                         **common}] for g, p in enumerate(prompts)],
               "singles": lambda seed: [[{"prompt": p, "n": 1, "seed": seed + g * a.rollout_n + i, **common}
                                         for i in range(a.rollout_n)] for g, p in enumerate(prompts)]}
    server = {"--max-n": a.rollout_n, "--dynamic-batch-max-size": a.rollout_n}
    for mode, names in (("step", ("groups", "singles")), ("request", ("groups",))):
        with b.servers(mode, {"--batching-mode": mode, **server}) as served:
            for layout in names:
                f.update(_rollout_layout(b, served.urls[0], f"{layout}, {mode}", layouts[layout],
                                         len(prompts) * a.rollout_n))
    f["samples/s, groups / singles, step"] = ratio(f["samples/s, groups, step"], f["samples/s, singles, step"])
    f["samples/s, groups, step / request"] = ratio(f["samples/s, groups, step"], f["samples/s, groups, request"])
    return f


async def _rollouts(url: str, bodies: list[dict]) -> tuple[float, list[float | None]]:
    """Every body at once to /v1/rollouts: (wall seconds, each one's latency, None if it failed)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(i: int) -> float | None:
            start = time.perf_counter()
            async with session.post(f"{url}/v1/rollouts", json=bodies[i]) as response:
                await response.read()
                return time.perf_counter() - start if response.status == 200 else None

        start = time.perf_counter()
        latencies = await kit.drive(one, len(bodies))
        return time.perf_counter() - start, latencies


def _rollout_layout(b: Bench, url: str, name: str, layout, samples: int) -> dict[str, float | None]:
    """One layout against one server: a warm-up, then ``--rollout-repeats`` timed repeats."""
    walls, lasts, failed = [], [], 0
    for repeat in range(b.args.rollout_repeats + 1):  # the first is the warm-up
        groups = layout(1000 * repeat)
        wall, latencies = asyncio.run(_rollouts(url, [body for g in groups for body in g]))
        failed += latencies.count(None)
        if repeat and None not in latencies:
            walls.append(wall)
            per_group, i = [], 0
            for g in groups:  # a group is done when its last request is
                per_group.append(max(latencies[i:i + len(g)]))
                i += len(g)
            lasts.append(statistics.mean(per_group))
    b.runs.append({"label": name, "round": b.round, "completed": len(walls) * samples,
                   "failed": failed, "walls_s": walls, "last_sample_s": lasts,
                   "config": {"num_prompts": len(walls) * samples + failed}})
    b.failed |= failed > 0
    rate = samples / statistics.median(walls) if walls else None
    last = ms(statistics.median(lasts)) if lasts else None
    print(f"[{name}] {rate or 0:.2f} samples/s, last sample of a group {last or 0:.0f} ms, "
          f"failed {failed}", flush=True)
    return {f"samples/s, {name}": rate, f"last sample of a group ms, {name}": last}


def rollout_args(p) -> None:
    p.add_argument("--rollout-prompts", type=int, default=4, help="rollout: prompts (groups).")
    p.add_argument("--rollout-n", type=int, default=16, help="rollout: samples per prompt; also "
                   "the servers' --max-n and --dynamic-batch-max-size.")
    p.add_argument("--rollout-repeats", type=int, default=3, help="rollout: timed repeats per layout.")


SCENARIOS = {
    "lora": Scenario(lora, [("saturated img/s, 16 adapters / none, rank 8", ">=", 0.8),
                            ("saturated img/s, 16 adapters, step/request, rank 8", ">=", 2.0),
                            ("p99 @70%, 16 adapters / none, rank 8", "<=", 1.3)], lora_args),
    "sizes": Scenario(sizes, [*((f"p99 {i}, mixed / alone", "<=", 1.6) for i in ("size 1", "size 2")),
                              *((f"p50 {i}, step / request", "<=", 0.85) for i in ("size 1", "size 2")),
                              ("images per forward, mixed / uniform", ">=", 0.8),
                              ("p99 rare size (90/10), mixed / alone", "<=", 2.0),
                              ("saturated img/s mixed, step / request", ">=", 0.95)], sizes_args),
    "rollout": Scenario(rollout, [("samples/s, groups / singles, step", ">=", 1.3),
                                  ("samples/s, groups, step / request", ">=", 1.0)], rollout_args),
}
