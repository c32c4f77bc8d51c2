"""Named scenarios against diffserve servers that this script starts, one server (or one set of
servers) at a time, loaded over the OpenAI images API; each scenario is the function of its name
(docs/benchmark-tools.md says what each measures).

    python benchmarks/compare.py modes --model shapes --rounds 3 --output-dir results/modes
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kit import cli, loadgen, server_metrics, servers, stats
from kit.servers import Bench, Scenario
from kit.stats import ms, ratio
from diffserve.builders.random.loras import write_lora

STEP_OVER_REQUEST = "step/request"
QUALITY_DB = 30.0  # the cache scenario's bound on an image's PSNR against its uncached twin
BEST = f"best img/s / uncached at PSNR >= {QUALITY_DB:g} dB"


def modes(b: Bench, full: bool = True) -> dict[str, float | None]:
    """Step mode against request mode: saturated, at ``--loads`` percent of request mode's
    saturation, with ``--mixed-steps``, and idle. Without ``full`` (``overhead``): the first and last."""
    a, f = b.args, {}
    for mode in ("request", "step"):  # request first: its saturation sets the offered loads
        with b.servers(f"{mode} mode", {"--batching-mode": mode}) as served:
            sat = b.load(served, f"{mode} saturated", max_concurrency=a.concurrency)
            f[f"saturated img/s, {mode}"] = sat["images_per_s"]
            f[f"saturated p99 ms, {mode}"] = ms(sat["latency_s"]["p99"])
            if full:
                rate = f.setdefault("request saturated req/s", sat["requests_per_s"])
                for load in a.loads:
                    lat = b.load(served, f"{mode} {load}%", request_rate=rate * load / 100)["latency_s"]
                    f[f"p50 ms @{load}%, {mode}"], f[f"p99 ms @{load}%, {mode}"] = ms(lat["p50"]), ms(lat["p99"])
                half = 0.5 * rate * (a.steps or a.default_steps) / statistics.mean(a.mixed_steps)
                mixed = b.load(served, f"{mode} mixed", request_rate=half, mixed_steps=a.mixed_steps)
                f[f"short mean ms (mixed), {mode}"] = ms(mixed["latency_by_steps_s"][str(min(a.mixed_steps))]["mean"])
            # Idle overhead: a lone request's latency beyond its time in the engine and the batching delay.
            idle = b.load(served, f"{mode} idle", max_concurrency=1, num_prompts=a.idle_requests)
            lone = idle["latency_s"]["mean"], (idle["server_metrics"] or {}).get("mean_request_execution_s")
            f[f"idle overhead ms, {mode}"] = None if None in lone else ms(lone[0] - lone[1]) - a.batch_delay_ms
    if full:
        for name in ["saturated img/s", "saturated p99 ms", "short mean ms (mixed)",
                     *(f"{p} ms @{load}%" for load in a.loads for p in ("p50", "p99"))]:
            f[f"{name}, {STEP_OVER_REQUEST}"] = ratio(f.get(f"{name}, step"), f.get(f"{name}, request"))
    return f


def closed_loop(b: Bench, systems: list[tuple[str, list[dict | None]]]) -> dict[str, float | None]:
    """img/s and p99 of each system (one or more servers) at --concurrency."""
    f = {}
    for name, configs in systems:
        with b.servers(name, *configs) as served:
            result = b.load(served, name, max_concurrency=b.args.concurrency)
        f[f"img/s, {name}"], f[f"p99 ms, {name}"] = result["images_per_s"], ms(result["latency_s"]["p99"])
    return f


def scale(b: Bench) -> dict[str, float | None]:
    """Two executors of one thread, one executor of two, two one-thread servers behind round-robin."""
    return closed_loop(b, [("dp2 x 1 thread", [{"--data-parallel-size": 2, "--torch-threads": 1}]),
                           ("1 executor x 2 threads", [{"--torch-threads": 2}]),
                           ("2 servers x 1 thread, round-robin", [{"--torch-threads": 1}] * 2)])


def baseline(b: Bench) -> dict[str, float | None]:
    """diffserve against itself unbatched (batches of 1) and against naive_server.py."""
    f = closed_loop(b, [("diffserve", [{}]), ("max batch 1", [{"--dynamic-batch-max-size": 1}]), ("naive", [None])])
    for other in ("max batch 1", "naive"):
        f[f"img/s, diffserve/{other}"] = ratio(f["img/s, diffserve"], f[f"img/s, {other}"])
    return f


def models(b: Bench) -> dict[str, float | None]:
    """Two models (--model as a, --second-model as b), requests alternating, at --concurrency: one
    server holding both (both resident; one resident, so that changes of model are swaps) against
    two servers of one model each; and the swaps' count and mean time."""
    a, f = b.args, {}
    pair = f"a={a.model},b={a.second_model}"
    systems = [("one server, both resident", [{"--model": pair}]),
               ("one server, one resident", [{"--model": pair, "--resident-models": 1,
                                              "--max-swap-wait-ms": a.swap_wait_ms}]),
               ("two servers", [{"--model": f"a={a.model}"}, {"--model": f"b={a.second_model}"}])]
    for name, configs in systems:  # request i goes to urls[i % 2] as model i % 2: a, then b
        with b.servers(name, *configs) as served:
            before = server_metrics.metrics(*served.urls)
            result = b.load(served, name, max_concurrency=a.concurrency, models=["a", "b"])
            after = server_metrics.metrics(*served.urls)
        f[f"img/s, {name}"], f[f"p99 ms, {name}"] = result["images_per_s"], ms(result["latency_s"]["p99"])
        if "--resident-models" in configs[0]:
            for way in ("in", "out"):
                count = server_metrics.change(before, after, "diffserve_model_swaps_total", direction=way)
                took = server_metrics.change(before, after, "diffserve_model_swap_seconds_sum", direction=way)
                f[f"swaps {way}"], f[f"mean swap {way} ms"] = count, ms(took / count) if count else None
    for name in ("one server, both resident", "one server, one resident"):
        f[f"img/s, {name} / two servers"] = ratio(f[f"img/s, {name}"], f["img/s, two servers"])
    return f


def plot(summary: dict, args, out_dir: Path, title: str) -> None:
    """modes.png: each mode's p50 and p99 against the offered load (where matplotlib is)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, color in (("request", "tab:blue"), ("step", "tab:orange")):
        for p, style in (("p50", "-"), ("p99", "--")):
            ys = [summary["medians"].get(f"{p} ms @{load}%, {mode}") for load in args.loads]
            ax.plot(args.loads, [float("nan") if y is None else y for y in ys], style, color=color, marker="o",
                    label=f"{mode} mode {p}")
    ax.set(xlabel="offered load, % of request mode's saturated req/s", ylabel="latency, ms", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "modes.png", dpi=120)
    plt.close(fig)


def lora(b: Bench) -> dict[str, float | None]:
    """Requests over k random adapters of each of ``--lora-ranks``: step mode saturated for each k of
    ``--lora-counts`` and at ``--lora-load`` percent, request mode saturated with the most."""
    a, f, most = b.args, {}, max(b.args.lora_counts)
    names = [f"L{i}" for i in range(most)]
    for rank in a.lora_ranks:
        root, tag = b.out_dir / "loras" / f"r{rank}", f"rank {rank}"
        for i, name in enumerate(names):
            if not (root / name).exists():
                write_lora(a.model, root / name, rank=rank, seed=i, weight_scale=0.2)
        flags = {"--lora-modules": [f"{n}={root / n}" for n in names], "--max-loras": max(most, 4),
                 "--max-lora-rank": rank}
        with b.servers(f"step, {tag}", {"--batching-mode": "step", **flags}) as served:
            for k in a.lora_counts:
                models = names[:k] or None
                sat = b.load(served, f"step k={k} {tag} saturated", max_concurrency=a.concurrency, models=models)
                f[f"saturated img/s, {k} adapters, step, {tag}"] = sat["images_per_s"]
                if k == 0:
                    rate = sat["requests_per_s"] * a.lora_load / 100
                if k in (0, most):
                    lat = b.load(served, f"step k={k} {tag} @{a.lora_load}%", request_rate=rate, models=models)
                    f[f"p99 ms @{a.lora_load}%, {k} adapters, {tag}"] = ms(lat["latency_s"]["p99"])
        with b.servers(f"request, {tag}", {"--batching-mode": "request", **flags}) as served:
            sat = b.load(served, f"request k={most} {tag} saturated", max_concurrency=a.concurrency, models=names)
            f[f"saturated img/s, {most} adapters, request, {tag}"] = sat["images_per_s"]
        with_most, without = (f.get(f"saturated img/s, {k} adapters, step, {tag}") for k in (most, 0))
        f[f"saturated img/s, {most} adapters / none, {tag}"] = ratio(with_most, without)
        f[f"saturated img/s, {most} adapters, step/request, {tag}"] = ratio(with_most, sat["images_per_s"])
        f[f"p99 @{a.lora_load}%, {most} adapters / none, {tag}"] = ratio(
            *(f.get(f"p99 ms @{a.lora_load}%, {k} adapters, {tag}") for k in (most, 0)))
    return f


def sizes(b: Bench) -> dict[str, float | None]:
    """Two ``--sizes`` mixed at ``--sizes-load`` percent of request mode's saturation, in each mode;
    in step mode also each size alone and only, and a 90/10 mix against the rare (second) alone."""
    a, f, rate = b.args, {}, None
    if len(a.sizes or []) != 2:
        raise SystemExit("compare.py sizes: needs --sizes with two sizes, e.g. 32x32,48x48")
    both, second = a.sizes, a.sizes[1]
    per_image = lambda run: (run["server_metrics"] or {}).get("mean_step_running_images")  # noqa: E731
    for name in ("request", "step"):  # request first: its saturation sets the offered load
        with b.servers(name, {"--batching-mode": name}) as served:
            sat = b.load(served, f"{name} saturated mixed", max_concurrency=a.concurrency, sizes=both)
            f[f"saturated img/s mixed, {name}"] = sat["images_per_s"]
            rate = rate or sat["requests_per_s"] * a.sizes_load / 100
            mixed = b.load(served, f"{name} mixed @{a.sizes_load}%", request_rate=rate, sizes=both)
            f.update({f"{p} ms size {i} ({size}), {name}": ms(mixed["latency_by_size_s"][size][p])
                      for i, size in enumerate(both, 1) for p in ("p50", "p99")})
            f[f"images per forward mixed, {name}"] = per_image(mixed)
            if name == "request":
                continue
            uniform = []
            for i, size in enumerate(both, 1):
                alone = b.load(served, f"step {size} alone", request_rate=rate / 2, sizes=[size],
                               num_prompts=a.num_requests // 2)
                f[f"p99 ms size {i} ({size}) alone"] = ms(alone["latency_s"]["p99"])
                uniform.append(per_image(b.load(served, f"step {size} only", request_rate=rate, sizes=[size])))
            f["images per forward, uniform"] = None if None in uniform else sum(uniform) / len(uniform)
            rare = b.load(served, "step 90/10", request_rate=rate, sizes=both, size_weights=[9, 1])
            f["p99 ms rare (90/10)"] = ms(rare["latency_by_size_s"][second]["p99"])
            rare_alone = b.load(served, "step rare alone", request_rate=rate / 10, sizes=[second],
                                num_prompts=max(8, a.num_requests // 4))
            f["p99 ms rare alone"] = ms(rare_alone["latency_s"]["p99"])
    for i, size in enumerate(both, 1):
        of = f"size {i} ({size})"
        f[f"p99 size {i}, mixed / alone"] = ratio(f.get(f"p99 ms {of}, step"), f.get(f"p99 ms {of} alone"))
        f[f"p50 size {i}, step / request"] = ratio(f.get(f"p50 ms {of}, step"), f.get(f"p50 ms {of}, request"))
    f["images per forward, mixed / uniform"] = ratio(f.get("images per forward mixed, step"),
                                                     f.get("images per forward, uniform"))
    f["p99 rare size (90/10), mixed / alone"] = ratio(f.get("p99 ms rare (90/10)"), f.get("p99 ms rare alone"))
    f["saturated img/s mixed, step / request"] = ratio(f.get("saturated img/s mixed, step"),
                                                       f.get("saturated img/s mixed, request"))
    return f


def mixing(b: Bench) -> dict[str, float | None]:
    """Sizes in one forward: the first of ``--sizes`` alone, then both mixed, at one rate (step
    mode, --size-mixing auto and off): each size's p50 and images per forward against uniform's."""
    a, f, rate = b.args, {}, None
    if len(a.sizes or []) != 2:
        raise SystemExit("compare.py mixing: needs --sizes with two sizes, e.g. 64x64,48x48")
    per_image = lambda run: (run["server_metrics"] or {}).get("mean_step_running_images")  # noqa: E731
    for name in ("auto", "off"):
        with b.servers(f"mixing {name}", {"--batching-mode": "step", "--size-mixing": name}) as served:
            if rate is None:  # the uniform traffic once, on the mixing server (one size: one set)
                sat = b.load(served, f"saturated {a.sizes[0]}", max_concurrency=a.concurrency,
                             sizes=a.sizes[:1])
                rate = f["rate req/s"] = sat["requests_per_s"] * a.sizes_load / 100
                uniform = b.load(served, f"uniform {a.sizes[0]}", request_rate=rate, sizes=a.sizes[:1])
                f["p50 ms uniform"] = ms(uniform["latency_s"]["p50"])
                f["images per forward, uniform"] = per_image(uniform)
            mixed = b.load(served, f"mixed, {name}", request_rate=rate, sizes=a.sizes)
            for i, size in enumerate(a.sizes, 1):
                f[f"p50 ms size {i} ({size}), {name}"] = ms(mixed["latency_by_size_s"][size]["p50"])
            f[f"images per forward, {name}"] = per_image(mixed)
    for name in ("auto", "off"):
        for i, size in enumerate(a.sizes, 1):
            f[f"p50 size {i}, {name} / uniform"] = ratio(f[f"p50 ms size {i} ({size}), {name}"],
                                                         f["p50 ms uniform"])
        f[f"images per forward, {name} / uniform"] = ratio(f[f"images per forward, {name}"],
                                                          f["images per forward, uniform"])
    return f


def rules(b: Bench) -> dict[str, float | None]:
    """Two ``--sizes`` in turn at ``--sizes-load`` percent of request mode's saturation on the
    first size alone (one rate and the same arrivals for every server), request mode against step
    mode under each of ``--set-policies``: each size's p50 and p99, and step ÷ request."""
    a, f, rate = b.args, {}, None
    body = {"extra_body": {"guidance_scale": a.guidance_scale}} if a.guidance_scale is not None else {}
    for name in ("request", *a.set_policies):  # request first: its saturation sets the rate
        flags = {"--batching-mode": "request"} if name == "request" else {"--batching-mode": "step",
                                                                           "--set-policy": name}
        with b.servers(name, flags) as served:
            if rate is None:
                sat = b.load(served, f"request saturated {a.sizes[0]}", max_concurrency=a.concurrency,
                             sizes=a.sizes[:1], **body)
                rate = f["rate req/s"] = sat["requests_per_s"] * a.sizes_load / 100
            mixed = b.load(served, f"{name} mixed", request_rate=rate, sizes=a.sizes, **body)["latency_by_size_s"]
            for i, size in enumerate(a.sizes, 1):
                for p in ("p50", "p99"):
                    f[f"{p} ms size {i}, {name}"] = ms(mixed[size][p])
                if name != "request":
                    f[f"p50 size {i}, {name} / request"] = ratio(f[f"p50 ms size {i}, {name}"],
                                                                  f[f"p50 ms size {i}, request"])
    return f


def rollout(b: Bench) -> dict[str, float | None]:
    """``/v1/rollouts``: ``--rollout-prompts`` x ``--rollout-n`` samples at once, a request per prompt
    (both modes) against a request per sample (step mode): samples/s and a group's last sample."""
    f, n = {}, b.args.rollout_n
    for mode, layouts in (("step", ("groups", "singles")), ("request", ("groups",))):
        with b.servers(mode, {"--batching-mode": mode, "--max-n": n, "--dynamic-batch-max-size": n}) as served:
            for layout in layouts:
                f.update(rollout_layout(b, served.urls[0], f"{layout}, {mode}", n if layout == "groups" else 1))
    f["samples/s, groups / singles, step"] = ratio(f["samples/s, groups, step"], f["samples/s, singles, step"])
    f["samples/s, groups, step / request"] = ratio(f["samples/s, groups, step"], f["samples/s, groups, request"])
    return f


def rollout_layout(b: Bench, url: str, name: str, per_request: int) -> dict[str, float | None]:
    """``per_request`` samples a request: a warm-up, then ``--rollout-repeats`` timed repeats."""
    a, n, prompts = b.args, b.args.rollout_n, cli.prompts()[:b.args.rollout_prompts]
    common = {**({"num_inference_steps": a.steps} if a.steps else {}), **({"size": a.size} if a.size else {})}
    samples = len(prompts) * n

    async def send_all(bodies: list[dict]) -> tuple[list[float | None], float]:
        async with loadgen.session() as session:
            async def one(i: int) -> float | None:  # its latency, None if it failed
                start = time.perf_counter()
                async with session.post(f"{url}/v1/rollouts", json=bodies[i]) as response:
                    await response.read()
                    return time.perf_counter() - start if response.status == 200 else None

            start = time.perf_counter()
            return await loadgen.drive(one, len(bodies)), time.perf_counter() - start

    walls, lasts, failed = [], [], 0
    for repeat in range(a.rollout_repeats + 1):  # the first is the warm-up
        groups = [[{"prompt": p, "n": per_request, "seed": 1000 * repeat + g * n + i, **common}
                   for i in range(0, n, per_request)] for g, p in enumerate(prompts)]
        latencies, wall = asyncio.run(send_all([body for g in groups for body in g]))
        failed += latencies.count(None)
        if repeat and None not in latencies:
            walls.append(wall)
            each = iter(latencies)  # a group is done when its last request is
            lasts.append(statistics.mean(max(next(each) for _ in g) for g in groups))
    b.runs.append({"label": name, "round": b.round, "completed": len(walls) * samples, "failed": failed,
                   "walls_s": walls, "last_sample_s": lasts, "config": {"num_prompts": len(walls) * samples + failed}})
    b.failed |= failed > 0
    rate, last = ratio(samples, stats.median(walls)), ms(stats.median(lasts))
    print(f"[{name}] {rate or 0:.2f} samples/s, last sample of a group {last or 0:.0f} ms, failed {failed}", flush=True)
    return {f"samples/s, {name}": rate, f"last sample of a group ms, {name}": last}


def cache(b: Bench) -> dict[str, float | None]:
    """``--step-cache first-block`` at 0 and each of ``--cache-thresholds``: saturated img/s, rows that
    hit (warm-up included), and the PSNR of ``--cache-images`` against their uncached twins."""
    a, f, twins = b.args, {}, None
    thresholds = sorted(set([0.0, *a.cache_thresholds]))
    for threshold in thresholds:
        name = f"threshold {threshold:g}"
        config = {"--batching-mode": "step", "--step-cache": "first-block", "--cache-threshold": threshold}
        with b.servers(name, config) as served:
            url = served.urls[0]
            before = server_metrics.metrics(url)
            result = b.load(served, name, max_concurrency=a.concurrency)
            after = server_metrics.metrics(url)
            images = asyncio.run(sample(url, a.cache_images, a.steps, a.size))
        f[f"img/s, {name}"] = result["images_per_s"]
        hit, miss = (server_metrics.change(before, after, "diffserve_step_cache_rows_total", outcome=k) or 0.0
                     for k in ("hit", "miss"))
        f[f"rows that hit, {name}"] = hit / (hit + miss) if hit + miss else None
        if twins is None:
            twins = images
            continue
        scores = [stats.psnr(x, y) for x, y in zip(images, twins)]
        f[f"PSNR min dB, {name}"], f[f"PSNR median dB, {name}"] = min(scores), float(np.median(scores))
        f[f"img/s, {name} / uncached"] = ratio(result["images_per_s"], f["img/s, threshold 0"])
    f[BEST] = max((f[f"img/s, threshold {t:g} / uncached"] for t in thresholds[1:]
                   if f.get(f"PSNR min dB, threshold {t:g}", 0) >= QUALITY_DB
                   and f.get(f"img/s, threshold {t:g} / uncached") is not None), default=None)
    return f


async def sample(url: str, count: int, steps: int | None, size: str | None) -> list[np.ndarray]:
    """``count`` images of fixed prompts and seeds, requested together."""
    extra = {**({"num_inference_steps": steps} if steps else {}), **({"size": size} if size else {})}
    async with loadgen.session() as client:
        return await loadgen.drive(lambda i: loadgen.image(
            client, url, {"prompt": f"a coloured shape, number {i}", "seed": 7919 * i, **extra}), count)


def arguments(p) -> None:
    p.add_argument("--loads", type=cli.counts, default=[25, 50, 80, 100], help="modes: %% of saturation.")
    p.add_argument("--mixed-steps", type=cli.counts, default=[8, 32], help="modes: step counts to mix.")
    p.add_argument("--idle-requests", type=cli.count, default=32, help="modes, overhead: requests at concurrency 1.")
    p.add_argument("--lora-counts", type=cli.ints, default=[0, 1, 4, 16], help="lora: distinct adapters.")
    p.add_argument("--lora-ranks", type=cli.ints, default=[8, 64], help="lora: adapter ranks.")
    p.add_argument("--lora-load", type=int, default=70, help="lora: %% of saturation for the p99.")
    p.add_argument("--sizes", type=cli.names, help='sizes, mixing: the two sizes to mix, e.g. "32x32,48x48".')
    p.add_argument("--sizes-load", type=int, default=60, help="sizes, rules: %% of request mode's saturation; "
                   "mixing: of step mode's on the first size.")
    p.add_argument("--set-policies", type=cli.names, default=["fair", "srpt", "oldest"], help="rules: step mode's.")
    p.add_argument("--guidance-scale", type=float, help="rules: the requests' guidance_scale (None: the model's).")
    p.add_argument("--rollout-prompts", type=int, default=4, help="rollout: prompts (groups).")
    p.add_argument("--rollout-n", type=int, default=16, help="rollout: samples per prompt (the servers' --max-n).")
    p.add_argument("--rollout-repeats", type=int, default=3, help="rollout: timed repeats per layout.")
    p.add_argument("--cache-thresholds", type=cli.floats, default=[0.1, 0.3], help="cache: the thresholds besides 0.")
    p.add_argument("--cache-images", type=int, default=16, help="cache: images compared with their uncached twins.")
    p.add_argument("--second-model", default="tiny-sdxl", help="models: the second model (b; a is --model).")
    p.add_argument("--swap-wait-ms", type=float, default=1000, help="models: --max-swap-wait-ms, one resident.")


SCENARIOS = {
    "modes": Scenario(modes, [(f"saturated img/s, {STEP_OVER_REQUEST}", ">=", 0.95),
                              *((f"{p} ms @{load}%, {STEP_OVER_REQUEST}", "<=", 0.7)
                                for load in (50, 80) for p in ("p50", "p99")),
                              (f"short mean ms (mixed), {STEP_OVER_REQUEST}", "<=", 0.5),
                              ("idle overhead ms, step", "<=", 5.0), ("idle overhead ms, request", "<=", 5.0)], plot),
    "overhead": Scenario(lambda b: modes(b, full=False)),
    "scale": Scenario(scale),
    "baseline": Scenario(baseline),
    "lora": Scenario(lora, [("saturated img/s, 16 adapters / none, rank 8", ">=", 0.8),
                            ("saturated img/s, 16 adapters, step/request, rank 8", ">=", 2.0),
                            ("p99 @70%, 16 adapters / none, rank 8", "<=", 1.3)]),
    "sizes": Scenario(sizes, [*((f"p99 size {i}, mixed / alone", "<=", 1.6) for i in (1, 2)),
                              *((f"p50 size {i}, step / request", "<=", 0.85) for i in (1, 2)),
                              ("images per forward, mixed / uniform", ">=", 0.8),
                              ("p99 rare size (90/10), mixed / alone", "<=", 2.0),
                              ("saturated img/s mixed, step / request", ">=", 0.95)]),
    "mixing": Scenario(mixing, [*((f"p50 size {i}, auto / uniform", "<=", 1.0) for i in (1, 2)),
                                ("images per forward, auto / uniform", ">=", 0.9)]),
    "rules": Scenario(rules, [(f"p50 size {i}, {p} / request", "<=", 1.0) for p in ("fair", "srpt", "oldest")
                              for i in (1, 2)]),
    "rollout": Scenario(rollout, [("samples/s, groups / singles, step", ">=", 1.3),
                                  ("samples/s, groups, step / request", ">=", 1.0)]),
    "cache": Scenario(cache, [(BEST, ">=", 1.4)]),
    "models": Scenario(models, [("img/s, one server, both resident / two servers", ">=", 0.9)]),
}


def main(argv: list[str] | None = None) -> int:
    return servers.main(__doc__, SCENARIOS, argv, arguments, size=None, steps=None, num_requests=128, concurrency=32,
                        warmup=4, max_batch_size=8, batch_delay_ms=8.0, set_policy=None, scheduling_policy=None,
                        batching_mode=None, torch_threads=0, tree=None)


if __name__ == "__main__":
    sys.exit(main())
