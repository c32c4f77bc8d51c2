"""Named scenarios against diffserve servers that this script starts, one server (or one set of
servers) at a time, loaded over the OpenAI images API (see docs/benchmarks.md).

- ``modes``: step mode against request mode: saturated throughput and p99 (closed loop at
  ``--concurrency``); p50/p99 under Poisson arrivals at ``--loads`` percent of request mode's
  saturated req/s (also drawn in ``modes.png``); the short requests' mean latency with
  ``--mixed-steps`` at about 50% load; the idle overhead at concurrency 1 (a request's latency
  beyond its time in the engine and the batching delay).
- ``overhead``: what the server itself costs, in each mode: ``modes``' saturated and idle figures.
- ``scale``: ``--data-parallel-size 2`` x 1 thread, 1 executor x 2 threads, and two 1-thread
  servers behind round-robin, at ``--concurrency``.
- ``baseline``: diffserve, ``--dynamic-batch-max-size 1`` and naive_server.py at ``--concurrency``.
- ``lora``, ``sizes``, ``rollout`` (traffic.py) and ``cache`` (step_cache.py): see theirs.

``--tree DIR`` runs the servers from another checkout of the project (e.g. a git worktree of an
earlier commit), so that a change is measured against what it replaced with the same load
generator and the same rules.

Each figure is taken in each of ``--rounds`` rounds (fresh servers, ratios within a round); the
medians, with target verdicts, go to ``<scenario>.md`` and ``<scenario>.json`` in ``--output-dir``.

    python benchmarks/compare.py modes --model shapes --rounds 3 --output-dir results/modes
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import kit
import step_cache
import traffic
from kit import Bench, Scenario, ms, ratio

STEP_OVER_REQUEST = "step/request"


def modes(b: Bench, full: bool = True) -> dict[str, float | None]:
    """``full``: with the offered loads and the mixed steps (``modes``), else ``overhead``."""
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
                short = mixed["latency_by_steps_s"][str(min(a.mixed_steps))]
                f[f"short mean ms (mixed), {mode}"] = ms(short["mean"])
            idle = b.load(served, f"{mode} idle", max_concurrency=1, num_prompts=a.idle_requests)
            f[f"idle overhead ms, {mode}"] = idle_overhead_ms(b, idle)
    if full:
        for name in ["saturated img/s", "saturated p99 ms", "short mean ms (mixed)",
                     *(f"{p} ms @{load}%" for load in a.loads for p in ("p50", "p99"))]:
            f[f"{name}, {STEP_OVER_REQUEST}"] = ratio(f.get(f"{name}, step"), f.get(f"{name}, request"))
    return f


def idle_overhead_ms(b: Bench, idle: dict) -> float | None:
    """A lone request's latency beyond its time in the engine and the batching delay."""
    execution = (idle["server_metrics"] or {}).get("mean_request_execution_s")
    if execution is None or idle["latency_s"]["mean"] is None:
        return None
    return ms(idle["latency_s"]["mean"] - execution) - b.args.batch_delay_ms


def modes_args(p) -> None:
    p.add_argument("--loads", type=kit.counts, default=[25, 50, 80, 100], help="modes: %% of saturation.")
    p.add_argument("--mixed-steps", type=kit.counts, default=[8, 32], help="modes: step counts to mix.")
    p.add_argument("--idle-requests", type=kit.count, default=32,
                   help="modes, overhead: requests at concurrency 1.")


def closed_loop(b: Bench, systems: list[tuple[str, list[dict | None]]]) -> dict[str, float | None]:
    """img/s and p99 of each system (one or more servers) at --concurrency."""
    f = {}
    for name, configs in systems:
        with b.servers(name, *configs) as served:
            result = b.load(served, name, max_concurrency=b.args.concurrency)
        f[f"img/s, {name}"], f[f"p99 ms, {name}"] = result["images_per_s"], ms(result["latency_s"]["p99"])
    return f


def scale(b: Bench) -> dict[str, float | None]:
    return closed_loop(b, [("dp2 x 1 thread", [{"--data-parallel-size": 2, "--torch-threads": 1}]),
                           ("1 executor x 2 threads", [{"--torch-threads": 2}]),
                           ("2 servers x 1 thread, round-robin", [{"--torch-threads": 1}] * 2)])


def baseline(b: Bench) -> dict[str, float | None]:
    f = closed_loop(b, [("diffserve", [{}]), ("max batch 1", [{"--dynamic-batch-max-size": 1}]),
                        ("naive", [None])])
    for other in ("max batch 1", "naive"):
        f[f"img/s, diffserve/{other}"] = ratio(f["img/s, diffserve"], f[f"img/s, {other}"])
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
            ax.plot(args.loads, [float("nan") if y is None else y for y in ys], style, color=color,
                    marker="o", label=f"{mode} mode {p}")
    ax.set(xlabel="offered load, % of request mode's saturated req/s", ylabel="latency, ms", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "modes.png", dpi=120)
    plt.close(fig)
    print(f"plot: {out_dir / 'modes.png'}")


SCENARIOS = {
    "modes": Scenario(modes, [(f"saturated img/s, {STEP_OVER_REQUEST}", ">=", 0.95),
                              *((f"{p} ms @{load}%, {STEP_OVER_REQUEST}", "<=", 0.7)
                                for load in (50, 80) for p in ("p50", "p99")),
                              (f"short mean ms (mixed), {STEP_OVER_REQUEST}", "<=", 0.5),
                              ("idle overhead ms, step", "<=", 5.0), ("idle overhead ms, request", "<=", 5.0)],
                      modes_args, plot),
    "overhead": Scenario(lambda b: modes(b, full=False)),
    "scale": Scenario(scale), "baseline": Scenario(baseline),
    **traffic.SCENARIOS, **step_cache.SCENARIOS,
}


def main(argv: list[str] | None = None) -> int:
    return kit.main(__doc__, SCENARIOS, argv, size=None, steps=None, num_requests=128, concurrency=32,
                    warmup=4, max_batch_size=8, batch_delay_ms=8.0, set_policy=None, scheduling_policy=None,
                    batching_mode=None, torch_threads=0, tree=None)


if __name__ == "__main__":
    sys.exit(main())
