"""Named scenarios against diffserve servers that this script starts (``diffserve.launcher``),
one server (or one set of servers) at a time, loaded by bench_serving (see docs/benchmarks.md).

- ``modes``: step mode against request mode: saturated throughput and p99 (closed loop at
  ``--concurrency``); p50/p99 under Poisson arrivals at ``--loads`` percent of request mode's
  saturated req/s (also drawn in ``modes.png``); the short requests' mean latency with
  ``--mixed-steps`` at about 50% load; the idle overhead at concurrency 1.
- ``scale``: ``--data-parallel-size 2`` x 1 thread, 1 executor x 2 threads, and two 1-thread
  servers behind round-robin, at ``--concurrency``.
- ``baseline``: diffserve, ``--dynamic-batch-max-size 1`` and naive_server.py at ``--concurrency``.
- ``overhead``: what the server itself costs, in each mode: saturated img/s and p99 (closed loop
  at ``--concurrency``) and the idle overhead at concurrency 1 (a request's latency beyond its
  time in the engine and the batching delay).
- ``sizes``: two sizes (``--sizes``), Poisson arrivals at ``--sizes-load`` percent of request
  mode's saturated rate with the sizes alternating (seeded), in request mode, in step mode as it
  was before several running sets (``--before-tree``, a checkout of that commit) and in step
  mode now: each size's p50 and p99; each size's arrivals alone (same rate); one size only at the
  full rate (images per forward); a 90/10 mix with the rare size's arrivals alone; and the
  saturated throughput with mixed sizes.
- ``lora``: requests spread evenly over k distinct LoRA adapters (``--lora-counts``, 0 = none),
  random adapters of each rank in ``--lora-ranks`` written offline (``tools/loras.py``). Step
  mode: saturated img/s (closed loop at ``--concurrency``) for every k, and p99 under Poisson
  arrivals at ``--lora-load`` percent of the saturated rate without adapters, with none and with
  the most adapters; request mode (one stack per call) saturated with the most adapters.
- ``rollout``: ``POST /v1/rollouts`` on a flow-matching model: ``--rollout-prompts`` prompts x
  ``--rollout-n`` samples sent as one request per prompt (step mode, request mode) and as single
  requests of one sample each (step mode), all at once: samples/s and the time to the last sample
  of a group.
- ``cache``: ``--step-cache first-block`` at each of ``--cache-thresholds`` and at 0, one server
  each: saturated img/s, the rows that reused their cache, and each image's PSNR against its
  uncached twin (``step_cache.py``).

``--tree DIR`` runs the diffserve servers from another checkout of the project (e.g. a git
worktree of an earlier commit), so that a change is measured against what it replaced with the
same load generator and the same rules.

Each figure is taken in each of ``--rounds`` rounds (fresh servers, ratios within a round); the
medians, with target verdicts, go to ``<scenario>.md`` and ``<scenario>.json`` in ``--output-dir``.

    python benchmarks/compare.py modes --model shapes --rounds 3 --output-dir results/modes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # tools/

from figures import judge, median, ms, ratio  # noqa: E402
from bench_round import Bench  # noqa: E402
from step_cache import QUALITY_DB, cache  # noqa: E402
from traffic import lora, rollout, sizes  # noqa: E402

from diffserve.config import DEFAULT_MODEL  # noqa: E402
from diffserve.launcher import LaunchError  # noqa: E402

STEP_OVER_REQUEST = "step/request"
TARGETS = {  # scenario -> (figure, comparison, bound)
    "modes": [(f"saturated img/s, {STEP_OVER_REQUEST}", ">=", 0.95),
              *((f"{p} ms @{load}%, {STEP_OVER_REQUEST}", "<=", 0.7)
                for load in (50, 80) for p in ("p50", "p99")),
              (f"short mean ms (mixed), {STEP_OVER_REQUEST}", "<=", 0.5),
              ("idle overhead ms, step", "<=", 5.0), ("idle overhead ms, request", "<=", 5.0)],
    "scale": [], "baseline": [], "overhead": [],
    "sizes": [*((f"p99 {i}, mixed / alone", "<=", 1.6) for i in ("size 1", "size 2")),
              *((f"p50 {i}, step / request", "<=", 0.85) for i in ("size 1", "size 2")),
              ("images per forward, mixed / uniform", ">=", 0.8),
              ("p99 rare size (90/10), mixed / alone", "<=", 2.0),
              ("saturated img/s mixed, step / request", ">=", 0.95)],
    "rollout": [("samples/s, groups / singles, step", ">=", 1.3),
                ("samples/s, groups, step / request", ">=", 1.0)],
    "cache": [(f"best img/s / uncached at PSNR >= {QUALITY_DB:g} dB", ">=", 1.4)],
    "lora": [("saturated img/s, 16 adapters / none, rank 8", ">=", 0.8),
             ("saturated img/s, 16 adapters, step/request, rank 8", ">=", 2.0),
             ("p99 @70%, 16 adapters / none, rank 8", "<=", 1.3)],
}


def summarize(rounds: list[dict[str, float | None]], targets: list[tuple[str, str, float]]) -> dict:
    """Medians over rounds of every figure, and the verdict of each target on its median."""
    names = list(dict.fromkeys(name for r in rounds for name in r))
    by_round = {name: [r.get(name) for r in rounds] for name in names}
    medians = {name: median(values) for name, values in by_round.items()}
    verdicts = {name: judge(medians.get(name), op, bound) for name, op, bound in targets}
    return {"medians": medians, "by_round": by_round, "verdicts": verdicts}


def format_table(summary: dict, targets: list[tuple[str, str, float]]) -> str:
    bounds = {name: f"{op} {bound:g}" for name, op, bound in targets}
    word = {True: "met", False: "**MISSED**", None: "not measured"}
    num = lambda v: "n/a" if v is None else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"  # noqa: E731
    rows = ["| figure | median | by round | target | verdict |", "| --- | --- | --- | --- | --- |"]
    for name, value in summary["medians"].items():
        rounds = ", ".join(num(v) for v in summary["by_round"][name])
        rows.append(f"| {name} | {num(value)} | {rounds} | {bounds.get(name, '')} | "
                    f"{word[summary['verdicts'][name]] if name in bounds else ''} |")
    rows += [f"| {name} | n/a | | {bounds[name]} | not measured |" for name in bounds
             if name not in summary["medians"]]
    return "\n".join(rows)


def modes(b: Bench) -> dict[str, float | None]:
    a, f = b.args, {}
    for mode in ("request", "step"):  # request first: its saturation sets the offered loads
        with b.servers(f"{mode} mode", {"--batching-mode": mode}) as served:
            sat = b.load(served, f"{mode} saturated", max_concurrency=a.concurrency)
            f[f"saturated img/s, {mode}"] = sat["images_per_s"]
            f[f"saturated p99 ms, {mode}"] = ms(sat["latency_s"]["p99"])
            full = f.setdefault("request saturated req/s", sat["requests_per_s"])
            for load in a.loads:
                lat = b.load(served, f"{mode} {load}%", request_rate=full * load / 100)["latency_s"]
                f[f"p50 ms @{load}%, {mode}"], f[f"p99 ms @{load}%, {mode}"] = ms(lat["p50"]), ms(lat["p99"])
            rate = 0.5 * full * (a.steps or a.default_steps) / statistics.mean(a.mixed_steps)
            mixed = b.load(served, f"{mode} mixed", request_rate=rate, mixed_steps=a.mixed_steps)
            short = mixed["latency_by_steps_s"][str(min(a.mixed_steps))]
            f[f"short mean ms (mixed), {mode}"] = ms(short["mean"])
            idle = b.load(served, f"{mode} idle", max_concurrency=1, num_prompts=a.idle_requests)
            f[f"idle overhead ms, {mode}"] = idle_overhead_ms(b, idle)
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


def overhead(b: Bench) -> dict[str, float | None]:
    a, f = b.args, {}
    for mode in ("request", "step"):
        with b.servers(f"{mode} mode", {"--batching-mode": mode}) as served:
            sat = b.load(served, f"{mode} saturated", max_concurrency=a.concurrency)
            f[f"saturated img/s, {mode}"] = sat["images_per_s"]
            f[f"saturated p99 ms, {mode}"] = ms(sat["latency_s"]["p99"])
            idle = b.load(served, f"{mode} idle", max_concurrency=1, num_prompts=a.idle_requests)
            f[f"idle overhead ms, {mode}"] = idle_overhead_ms(b, idle)
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
    return closed_loop(b, [("dp2 x 1 thread", [{"--data-parallel-size": 2, "--torch-threads": 1}]),
                           ("1 executor x 2 threads", [{"--torch-threads": 2}]),
                           ("2 servers x 1 thread, round-robin", [{"--torch-threads": 1}] * 2)])


def baseline(b: Bench) -> dict[str, float | None]:
    f = closed_loop(b, [("diffserve", [{}]), ("max batch 1", [{"--dynamic-batch-max-size": 1}]),
                        ("naive", [None])])
    for other in ("max batch 1", "naive"):
        f[f"img/s, diffserve/{other}"] = ratio(f["img/s, diffserve"], f[f"img/s, {other}"])
    return f


SCENARIOS = {"modes": modes, "scale": scale, "baseline": baseline, "overhead": overhead,
             "lora": lora, "sizes": sizes, "rollout": rollout, "cache": cache}


def plot(summary: dict, loads: list[int], path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, color in (("request", "tab:blue"), ("step", "tab:orange")):
        for p, style in (("p50", "-"), ("p99", "--")):
            ys = [summary["medians"].get(f"{p} ms @{load}%, {mode}") for load in loads]
            ax.plot(loads, [float("nan") if y is None else y for y in ys], style, color=color, marker="o",
                    label=f"{mode} mode {p}")
    ax.set(xlabel="offered load, % of request mode's saturated req/s", ylabel="latency, ms", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ints = lambda text: [int(v) for v in text.split(",") if v.strip()]  # noqa: E731
    p.add_argument("scenario", choices=SCENARIOS)
    p.add_argument("--model", default=DEFAULT_MODEL, help="Model for every server (e.g. shapes, sd-mid).")
    p.add_argument("--size", default=None, help='"WIDTHxHEIGHT" (default: the model\'s).')
    p.add_argument("--steps", type=int, default=None, help="num_inference_steps (default: the model's).")
    p.add_argument("--num-requests", type=int, default=128, help="Requests per measurement.")
    p.add_argument("--concurrency", type=int, default=32, help="Closed-loop concurrency (saturation).")
    p.add_argument("--loads", type=ints, default=[25, 50, 80, 100], help="modes: %% of saturation.")
    p.add_argument("--mixed-steps", type=ints, default=[8, 32], help="modes: step counts to mix.")
    p.add_argument("--idle-requests", type=int, default=32, help="modes: requests at concurrency 1.")
    p.add_argument("--warmup", type=int, default=4, help="Untimed requests per server per measurement.")
    p.add_argument("--sizes", type=lambda t: [v.strip() for v in t.split(",")], default=None,
                   help='sizes: the two sizes to mix, e.g. "32x32,48x48" (required).')
    p.add_argument("--sizes-load", type=int, default=60, help="sizes: %% of request mode's saturation.")
    p.add_argument("--before-tree", default=None, help="sizes: a checkout of step mode as it was "
                   "before several running sets, measured beside.")
    p.add_argument("--lora-counts", type=ints, default=[0, 1, 4, 16], help="lora: distinct adapters.")
    p.add_argument("--lora-ranks", type=ints, default=[8, 64], help="lora: adapter ranks.")
    p.add_argument("--lora-load", type=int, default=70, help="lora: %% of saturation for the p99.")
    p.add_argument("--rollout-prompts", type=int, default=4, help="rollout: prompts (groups).")
    p.add_argument("--rollout-n", type=int, default=16, help="rollout: samples per prompt; also "
                   "the servers' --max-n and --dynamic-batch-max-size.")
    p.add_argument("--rollout-repeats", type=int, default=3, help="rollout: timed repeats per layout.")
    p.add_argument("--cache-thresholds", type=lambda t: [float(v) for v in t.split(",") if v.strip()],
                   default=[0.1, 0.3], help="cache: the thresholds besides 0.")
    p.add_argument("--cache-images", type=int, default=16, help="cache: images compared with "
                   "their uncached twins per threshold.")
    p.add_argument("--max-batch-size", type=int, default=8, help="--dynamic-batch-max-size.")
    p.add_argument("--batch-delay-ms", type=float, default=8.0, help="--dynamic-batch-delay-ms.")
    p.add_argument("--set-policy", default=None, help="--set-policy of every server (step mode: "
                   "which running set a step advances; e.g. sizes with fair, then with srpt).")
    p.add_argument("--scheduling-policy", default=None, help="--scheduling-policy of every server.")
    p.add_argument("--batching-mode", choices=("auto", "step", "request"), default=None,
                   help="scale, baseline: the servers' mode (default: theirs).")
    p.add_argument("--torch-threads", type=int, default=0, help="Per executor, where a scenario sets none.")
    p.add_argument("--rounds", type=int, default=1, help="Repeat with fresh servers; report medians.")
    p.add_argument("--tree", default=None, help="Run the diffserve servers from this checkout of "
                   "the project instead of the installed one (e.g. a worktree of an earlier commit).")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="Longest server start, s.")
    p.add_argument("--output-dir", default=None, help="Default: benchmarks/results/<scenario>-<time>.")
    args = p.parse_args(argv)
    if min(args.num_requests, args.concurrency, args.rounds, args.idle_requests, *args.mixed_steps) < 1:
        p.error("counts and step counts must be >= 1")
    out_dir = Path(args.output_dir or HERE / "results" / time.strftime(f"{args.scenario}-%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    from diffserve.models.registry import resolve_model, serving_defaults

    # Built once now, not by several servers at once; the steps a saturated request runs.
    if args.scenario == "sizes" and len(args.sizes or []) != 2:
        p.error("sizes needs --sizes with two sizes, e.g. 32x32,48x48")
    args.default_steps = int(serving_defaults(resolve_model(args.model)).get("num_inference_steps", 20))
    rounds, failed = [], False
    for index in range(args.rounds):
        print(f"=== {args.scenario}, round {index + 1}/{args.rounds}", flush=True)
        bench = Bench(args, out_dir, index + 1)
        try:
            figures = SCENARIOS[args.scenario](bench)
        except (LaunchError, RuntimeError, OSError) as error:
            print(f"round {index + 1} failed: {error}", file=sys.stderr)
            figures, bench.failed = {"error": str(error)}, True
        failed |= bench.failed
        rounds.append({"figures": figures, "runs": bench.runs})
    targets = TARGETS[args.scenario]
    summary = summarize([{k: v for k, v in r["figures"].items() if k != "error"} for r in rounds], targets)
    title = (f"{args.scenario}: {args.model}, steps {args.steps or args.default_steps}, "
             f"{args.num_requests} requests/measurement, {args.rounds} round(s)")
    text = f"# {title}\n\n{format_table(summary, targets)}\n"
    report = {"scenario": args.scenario, "config": vars(args), "summary": summary,
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
              "targets": [{"figure": name, "op": op, "bound": bound, "met": summary["verdicts"][name]}
                          for name, op, bound in targets], "rounds": rounds}
    (out_dir / f"{args.scenario}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{args.scenario}.md").write_text(text)
    print("\n" + text)
    if args.scenario == "modes" and plot(summary, args.loads, out_dir / "modes.png", title):
        print(f"plot: {out_dir / 'modes.png'}")
    print(f"results: {out_dir / (args.scenario + '.json')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
