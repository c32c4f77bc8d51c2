"""compare.py's arithmetic and output: the headline ratios, the merge of several rounds, the
table and the plot. Pure functions of the results, so they are tested on synthetic rounds."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from bench_serving import _percentiles

# The targets docs/benchmarks.md states, checked on every run.
MIN_SATURATED_SHARE = {"cpu": 0.85, "cuda": 0.95}  # served img/s over offline B=max
MIN_GAIN_SHARE = 0.9         # served batching gain over offline batching gain
MAX_IDLE_OVERHEAD_MS = 5.0   # idle latency beyond pipeline time and batching delay


def _level(record: dict, concurrency: int) -> dict | None:
    for level in record.get("levels", []):
        if level.get("concurrency") == concurrency and "images_per_s" in level:
            return level
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(args, runs: list[dict], offline: dict | None) -> dict:
    by_name = {r["system"]: r for r in runs}
    top = max(args.concurrency)

    def ips(name: str, concurrency: int) -> float | None:
        level = _level(by_name.get(name, {}), concurrency)
        return level["images_per_s"] if level else None

    off = {r["batch_size"]: r["images_per_s"] for r in (offline or {}).get("results", [])}
    off_b1 = off.get(1)
    off_max_b = max(off) if off else None
    off_max = off.get(off_max_b) if off_max_b else None
    per_level = {}
    for c in args.concurrency:
        per_level[c] = {
            "diffserve_vs_b1": _ratio(ips("diffserve", c), ips("diffserve-b1", c)),
            "diffserve_vs_naive": _ratio(ips("diffserve", c), ips("naive", c)),
            "b1_vs_naive": _ratio(ips("diffserve-b1", c), ips("naive", c)),
        }
    # Idle latency at the lowest level (1 for the targets) of the batched server, two ways: over
    # the offline B=1 call plus the batching delay (the target: <= 5 ms), and over its own
    # executor's mean call time (same process and minutes, so free of drift between processes).
    low = min(args.concurrency)
    idle = _level(by_name.get("diffserve", {}), low)
    idle_over_offline = idle_over_executor = None
    if idle:
        delay = args.batch_delay_ms / 1000
        b1 = next((r["median_s"] for r in (offline or {}).get("results", []) if r["batch_size"] == 1),
                  None)
        if b1 is not None and idle["latency_s"]["p50"] is not None:
            idle_over_offline = 1000 * (idle["latency_s"]["p50"] - b1 - delay)
        sm = idle.get("server_metrics") or {}
        if sm.get("mean_batch_execution_s") is not None and low == 1:
            idle_over_executor = 1000 * (idle["latency_s"]["mean"] - sm["mean_batch_execution_s"]
                                         - delay)
    return {
        "top_concurrency": top,
        "idle_concurrency": low,
        "idle_p50_over_offline_b1_and_delay_ms": idle_over_offline,
        "idle_mean_over_executor_and_delay_ms": idle_over_executor,
        "offline_images_per_s": off,
        "offline_max_batch": off_max_b,
        "saturated_diffserve_vs_offline_max": _ratio(ips("diffserve", top), off_max),
        "saturated_b1_vs_offline_b1": _ratio(ips("diffserve-b1", top), off_b1),
        "batching_gain_served": _ratio(ips("diffserve", top), ips("diffserve-b1", top)),
        "batching_gain_offline": _ratio(off_max, off_b1),
        "ratios_by_concurrency": per_level,
    }


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# The server figures of a level that several rounds merge into their median.
_SERVER_FIGURES = ("mean_batch_size", "mean_queue_time_s", "mean_batch_execution_s",
                   "executor_busy_fraction", "mean_request_execution_s", "mean_server_overhead_s",
                   "mean_client_and_http_s")


def merge_rounds(systems: list[str], rounds: list[dict]) -> tuple[list[dict], dict | None]:
    """One record per system and one offline result from several rounds: medians of the
    throughputs and server figures, latency percentiles over every request of every round."""
    runs = []
    for name in systems:
        records = [r for rnd in rounds for r in rnd["runs"] if r["system"] == name]
        merged = {k: records[0][k] for k in ("system", "label", "command")}
        merged["levels"] = []
        if all(r.get("error") for r in records):
            merged["error"] = records[0]["error"]
        levels = sorted({lv["concurrency"] for r in records for lv in r.get("levels", [])})
        for c in levels:
            ok = [lv for lv in (_level(r, c) for r in records) if lv is not None]
            if not ok:
                merged["levels"].append({"concurrency": c, "error": "failed in every round"})
                continue
            latencies = [x for lv in ok for x in lv["latencies_s"]]
            server = [lv.get("server_metrics") or {} for lv in ok]
            merged["levels"].append({
                "concurrency": c, "rounds": len(ok),
                "images_per_s": _median([lv["images_per_s"] for lv in ok]),
                "images_per_s_by_round": [lv["images_per_s"] for lv in ok],
                "requests_per_s": _median([lv["requests_per_s"] for lv in ok]),
                "latency_s": _percentiles(latencies), "latencies_s": latencies,
                "failed": sum(lv["failed"] for lv in ok),
                "server_metrics": {k: _median([sm.get(k) for sm in server])
                                   for k in _SERVER_FIGURES} if any(server) else None,
            })
        runs.append(merged)
    offlines = [rnd["offline"] for rnd in rounds if rnd.get("offline")]
    if not offlines:
        return runs, None
    offline = dict(offlines[0])
    sizes = [r["batch_size"] for r in offlines[0]["results"]]
    offline["results"] = [{
        "batch_size": b,
        "images_per_s": _median([r["images_per_s"] for o in offlines for r in o["results"]
                                 if r["batch_size"] == b]),
        "median_s": _median([r["median_s"] for o in offlines for r in o["results"]
                             if r["batch_size"] == b]),
        "images_per_s_by_round": [r["images_per_s"] for o in offlines for r in o["results"]
                                  if r["batch_size"] == b],
    } for b in sizes]
    return runs, offline


_HEADLINE = ("saturated_diffserve_vs_offline_max", "saturated_b1_vs_offline_b1",
             "batching_gain_served", "batching_gain_offline",
             "idle_p50_over_offline_b1_and_delay_ms", "idle_mean_over_executor_and_delay_ms")


def combine_summaries(args, runs: list[dict], offline: dict | None, rounds: list[dict]) -> dict:
    """The summary of the merged results, with each headline ratio replaced by the median of
    the per-round ratios (each taken between measurements close together in time)."""
    summary = summarize(args, runs, offline)
    if len(rounds) > 1:
        for key in _HEADLINE:
            per_round = [rnd["summary"][key] for rnd in rounds]
            summary[key] = _median(per_round)
            summary[key + "_by_round"] = per_round
    return summary


def targets(summary: dict, device: str | None) -> list[tuple[str, float | None, str, bool | None]]:
    """(target, measured, bound, met) for each stated target; met is None when not measured.
    Idle overhead is judged on the server's own figures (client mean latency minus its
    executor's mean call time and the delay): the offline B=1 call ran in another process,
    minutes apart, and differs from the server's by more than the 5 ms being judged."""
    kind = "cuda" if (device or "cpu").startswith("cuda") else "cpu"
    share = MIN_SATURATED_SHARE[kind]
    gain_offline = summary.get("batching_gain_offline")
    gain_bound = None if gain_offline is None else MIN_GAIN_SHARE * gain_offline

    def check(value, bound, at_least: bool) -> bool | None:
        if value is None or bound is None:
            return None
        return value >= bound if at_least else value <= bound

    saturated = summary.get("saturated_diffserve_vs_offline_max")
    gain = summary.get("batching_gain_served")
    idle = summary.get("idle_mean_over_executor_and_delay_ms")
    return [
        ("saturated / offline B=max", saturated, f">= {share:.2f} ({kind})",
         check(saturated, share, True)),
        ("batching gain served", gain,
         "-" if gain_bound is None else f">= {gain_bound:.2f} ({MIN_GAIN_SHARE:g} x offline)",
         check(gain, gain_bound, True)),
        ("idle overhead, ms", idle, f"<= {MAX_IDLE_OVERHEAD_MS:g}",
         check(idle, MAX_IDLE_OVERHEAD_MS, False)),
    ]


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def format_tables(args, runs: list[dict], offline: dict | None, summary: dict) -> str:
    lines = [f"{'system':<28}{'conc':>5}{'img/s':>9}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}"
             f"{'batch':>7}{'queue ms':>10}{'busy %':>8}{'failed':>8}"]
    lines.append("-" * len(lines[0]))
    for record in runs:
        if record.get("error"):
            lines.append(f"{record['label']:<28}  server did not start (see its log)")
            continue
        for level in record["levels"]:
            if "images_per_s" not in level:
                lines.append(f"{record['label']:<28}{level['concurrency']:>5}  error: "
                             f"{level.get('error', '')[:60]}")
                continue
            sm = level.get("server_metrics") or {}
            lines.append(
                f"{record['label']:<28}{level['concurrency']:>5}{level['images_per_s']:>9.2f}"
                f"{level['requests_per_s']:>8.2f}{_fmt(level['latency_s']['p50'], '.0f', 1000):>9}"
                f"{_fmt(level['latency_s']['p99'], '.0f', 1000):>9}"
                f"{_fmt(sm.get('mean_batch_size'), '.2f'):>7}"
                f"{_fmt(sm.get('mean_queue_time_s'), '.1f', 1000):>10}"
                f"{_fmt(sm.get('executor_busy_fraction'), '.1f', 100):>8}{level['failed']:>8}")
    if offline:
        for r in offline["results"]:
            lines.append(f"{'offline (in-process) B=' + str(r['batch_size']):<28}{'-':>5}"
                         f"{r['images_per_s']:>9.2f}{'-':>8}{r['median_s'] * 1000:>9.0f}{'-':>9}"
                         f"{r['batch_size']:>7}{'-':>10}{'-':>8}{'-':>8}")
    lines += ["", f"{'throughput ratios':<28}" + "".join(f"{'c=' + str(c):>10}" for c in args.concurrency)]
    for key, text in (("diffserve_vs_b1", "batched / max-batch-1"),
                      ("diffserve_vs_naive", "batched / naive"),
                      ("b1_vs_naive", "max-batch-1 / naive")):
        lines.append(f"{text:<28}" + "".join(
            f"{_fmt(summary['ratios_by_concurrency'][c][key], '.2f'):>9}x" if
            summary['ratios_by_concurrency'][c][key] is not None else f"{'-':>10}"
            for c in args.concurrency))
    top, bmax = summary["top_concurrency"], summary["offline_max_batch"]

    def headline(key: str, suffix: str = "", spec: str = ".2f") -> str:
        text = _fmt(summary[key], spec) + (suffix if summary[key] is not None else "")
        by_round = summary.get(key + "_by_round")
        if by_round:
            text += "   (by round: " + ", ".join(_fmt(v, spec) for v in by_round) + ")"
        return text

    lines += [
        "",
        f"saturated diffserve (c={top}) / offline B={bmax}:       "
        + headline("saturated_diffserve_vs_offline_max"),
        f"saturated max-batch-1 (c={top}) / offline B=1:      "
        + headline("saturated_b1_vs_offline_b1"),
        f"batching gain served (batched / max-batch-1, c={top}): "
        + headline("batching_gain_served", "x"),
        f"batching gain offline (B={bmax} / B=1):               "
        + headline("batching_gain_offline", "x"),
    ]
    if summary.get("idle_concurrency") == 1:
        lines += [
            "idle p50 (batched, c=1) - offline B=1 - delay:      "
            + headline("idle_p50_over_offline_b1_and_delay_ms", " ms", ".1f"),
            "idle mean (batched, c=1) - its executor - delay:    "
            + headline("idle_mean_over_executor_and_delay_ms", " ms", ".1f"),
        ]
    lines += ["", f"{'target':<28}{'measured':>10}  {'bound':<24}verdict"]
    for name, value, bound, met in targets(summary, (offline or {}).get("device")):
        verdict = "not measured" if met is None else "met" if met else "MISSED"
        lines.append(f"{name:<28}{_fmt(value, '.2f'):>10}  {bound:<24}{verdict}")
    return "\n".join(lines)


def plot(args, runs: list[dict], offline: dict | None, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for record in runs:
        levels = [lv for lv in record.get("levels", []) if "images_per_s" in lv]
        if not levels:
            continue
        xs = [lv["concurrency"] for lv in levels]
        ax_tp.plot(xs, [lv["images_per_s"] for lv in levels], marker="o", label=record["label"])
        ax_lat.plot(xs, [1000 * (lv["latency_s"]["p99"] or float("nan")) for lv in levels],
                    marker="o", label=record["label"])
    if offline and offline.get("results"):
        results = offline["results"]
        for r, style in ((results[0], ":"), (results[-1], "--")):
            ax_tp.axhline(r["images_per_s"], color="grey", linestyle=style, linewidth=1,
                          label=f"offline B={r['batch_size']}")
    for ax in (ax_tp, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.concurrency, [str(c) for c in args.concurrency])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(True, alpha=0.3)
    ax_tp.set_ylabel("throughput (images/s)")
    ax_tp.set_ylim(bottom=0)
    ax_tp.set_title("throughput")
    ax_lat.set_ylabel("p99 latency (ms)")
    ax_lat.set_yscale("log")
    ax_lat.set_title("p99 latency")
    ax_tp.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
