"""compare.py's scenarios of heterogeneous traffic: LoRA adapters, mixed sizes and rollouts (see
compare.py's docstring for what each measures)."""

from __future__ import annotations

import asyncio
import statistics
import time

from bench_round import Bench
from figures import TREE, ms, ratio


def lora(b: Bench) -> dict[str, float | None]:
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


def sizes(b: Bench) -> dict[str, float | None]:
    """See the module docstring. "size 1" and "size 2" are --sizes in order; "rare" is size 2."""
    a, f = b.args, {}
    both, second = a.sizes, a.sizes[1]
    servers = {"request": {"--batching-mode": "request"}, "step": {"--batching-mode": "step"}}
    if a.before_tree:
        servers["step before"] = {"--batching-mode": "step", TREE: a.before_tree}
    per_image = lambda run: (run["server_metrics"] or {}).get("mean_step_running_images")  # noqa: E731
    rate = None
    for name, config in servers.items():
        with b.servers(name, config) as served:
            if name != "step before":
                sat = b.load(served, f"{name} saturated mixed", max_concurrency=a.concurrency,
                             sizes=both)
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
            f["images per forward, uniform"] = (None if None in uniform else sum(uniform) / len(uniform))
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
        if a.before_tree:
            f[f"p50 size {i}, step now / step before"] = ratio(
                f.get(f"p50 ms size {i} ({size}), step"), f.get(f"p50 ms size {i} ({size}), step before"))
    f["images per forward, mixed / uniform"] = ratio(f.get("images per forward mixed, step"),
                                                     f.get("images per forward, uniform"))
    f["p99 rare size (90/10), mixed / alone"] = ratio(f.get("p99 ms rare (90/10)"),
                                                      f.get("p99 ms rare alone"))
    f["saturated img/s mixed, step / request"] = ratio(f.get("saturated img/s mixed, step"),
                                                       f.get("saturated img/s mixed, request"))
    return f


ROLLOUT_PROMPTS = ["a red circle", "a blue square", "a green triangle", "a yellow star",
                   "an orange ring", "a purple cross", "a white disc", "a black bar"]


async def _rollouts(url: str, bodies: list[dict], timeout_s: float) -> tuple[float, list[float | None]]:
    """Send every body at once to /v1/rollouts; (wall seconds, each one's latency, None if failed)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async def one(body: dict) -> float | None:
            start = time.perf_counter()
            async with session.post(f"{url}/v1/rollouts", json=body) as response:
                await response.read()
                return time.perf_counter() - start if response.status == 200 else None

        start = time.perf_counter()
        latencies = await asyncio.gather(*(one(body) for body in bodies))
        return time.perf_counter() - start, list(latencies)


def rollout(b: Bench) -> dict[str, float | None]:
    """``--rollout-prompts`` prompts x ``--rollout-n`` samples: one request per prompt in step
    mode and in request mode, against the same samples as single requests (n=1, the seeds the
    group would use) in step mode. Per layout: samples/s (median of ``--rollout-repeats``) and
    the time to the last sample of a group (mean over groups). One server per mode; each layout
    on it has a warm-up of its own."""
    a, f = b.args, {}
    prompts = ROLLOUT_PROMPTS[:a.rollout_prompts]
    steps = {"num_inference_steps": a.steps} if a.steps else {}
    size = {"size": a.size} if a.size else {}
    server = {"--max-n": a.rollout_n, "--dynamic-batch-max-size": a.rollout_n}
    layouts = {"groups": lambda seed: [[{"prompt": p, "n": a.rollout_n, "seed": seed + g * a.rollout_n,
                                         **steps, **size}] for g, p in enumerate(prompts)],
               "singles": lambda seed: [[{"prompt": p, "n": 1, "seed": seed + g * a.rollout_n + i,
                                          **steps, **size} for i in range(a.rollout_n)]
                                        for g, p in enumerate(prompts)]}
    for mode, names in (("step", ("groups", "singles")), ("request", ("groups",))):
        with b.servers(mode, {"--batching-mode": mode, **server}) as (urls, _):
            for layout in names:
                f.update(_rollout_layout(b, urls[0], f"{layout}, {mode}", layouts[layout],
                                         len(prompts) * a.rollout_n))
    f["samples/s, groups / singles, step"] = ratio(f["samples/s, groups, step"],
                                                   f["samples/s, singles, step"])
    f["samples/s, groups, step / request"] = ratio(f["samples/s, groups, step"],
                                                   f["samples/s, groups, request"])
    return f


def _rollout_layout(b: Bench, url: str, name: str, layout, samples: int) -> dict[str, float | None]:
    """One layout against one server: a warm-up, then ``--rollout-repeats`` timed repeats."""
    walls, lasts, failed = [], [], 0
    for repeat in range(b.args.rollout_repeats + 1):  # the first is the warm-up
        groups = layout(1000 * repeat)
        wall, latencies = asyncio.run(_rollouts(url, [body for g in groups for body in g],
                                                timeout_s=3600))
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
