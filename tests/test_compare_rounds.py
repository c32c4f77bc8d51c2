"""compare.py's report: how several rounds become one table, and the target verdicts (pure
functions, synthetic rounds)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
compare = pytest.importorskip("compare_report")


def _level(c: int, ips: float, latencies: list[float], busy: float | None = None) -> dict:
    lat = sorted(latencies)
    return {"concurrency": c, "images_per_s": ips, "requests_per_s": ips, "failed": 0,
            "latencies_s": latencies,
            "latency_s": {"mean": sum(lat) / len(lat), "p50": lat[len(lat) // 2], "p99": lat[-1]},
            "server_metrics": None if busy is None else {
                "mean_batch_size": 8.0, "mean_queue_time_s": 0.01,
                "mean_batch_execution_s": 0.1, "executor_busy_fraction": busy}}


def _round(scale: float) -> dict:
    """One round where everything, the offline ceiling included, ran ``scale`` times as fast."""
    args = _args()
    runs = [
        {"system": "diffserve-b1", "label": "b1", "command": [], "levels": [
            _level(1, 10 * scale, [0.10, 0.11, 0.12], 0.9), _level(16, 10 * scale, [1.6] * 3, 1.0)]},
        {"system": "diffserve", "label": "batched", "command": [], "levels": [
            _level(1, 9 * scale, [0.11, 0.12, 0.13], 0.8), _level(16, 30 * scale, [0.5] * 3, 0.99)]},
    ]
    offline = {"results": [{"batch_size": 1, "images_per_s": 11 * scale, "median_s": 0.1 / scale},
                           {"batch_size": 8, "images_per_s": 33 * scale, "median_s": 0.24 / scale}]}
    return {"runs": runs, "offline": offline, "summary": compare.summarize(args, runs, offline)}


def _args() -> argparse.Namespace:
    return argparse.Namespace(concurrency=[1, 16], batch_delay_ms=8.0)


def test_rounds_merge_to_medians_and_ratios_are_taken_within_rounds():
    # The machine's speed drifted 2x between rounds, the server's share of it did not.
    rounds = [_round(1.0), _round(2.0), _round(0.5)]
    runs, offline = compare.merge_rounds(["diffserve-b1", "diffserve"], rounds)
    batched = {lv["concurrency"]: lv for lv in runs[1]["levels"]}
    assert batched[16]["images_per_s"] == 30  # median of 30, 60, 15
    assert batched[16]["images_per_s_by_round"] == [30, 60, 15]
    assert len(batched[1]["latencies_s"]) == 9  # percentiles over every request of every round
    assert batched[16]["server_metrics"]["executor_busy_fraction"] == 0.99
    assert [r["images_per_s"] for r in offline["results"]] == [11, 33]

    summary = compare.combine_summaries(_args(), runs, offline, rounds)
    # 30/33 in every round, whatever the drift.
    assert summary["saturated_diffserve_vs_offline_max"] == pytest.approx(30 / 33)
    assert summary["saturated_diffserve_vs_offline_max_by_round"] == [pytest.approx(30 / 33)] * 3
    assert summary["batching_gain_served"] == pytest.approx(3.0)
    # Idle: p50 0.12 s - 0.1 s offline B=1 - 8 ms = 12 ms in the round at scale 1.
    assert summary["idle_p50_over_offline_b1_and_delay_ms_by_round"][0] == pytest.approx(12.0)
    # Mean 0.12 s - executor 0.1 s - 8 ms = 12 ms, from the server's own figures.
    assert summary["idle_mean_over_executor_and_delay_ms"] == pytest.approx(12.0)
    text = compare.format_tables(_args(), runs, offline, summary)
    assert "by round: 0.91, 0.91, 0.91" in text
    assert "idle mean (batched, c=1)" in text


def test_a_system_that_failed_every_round_is_reported_as_failed():
    bad = {"system": "naive", "label": "naive", "command": [], "levels": [], "error": "no start"}
    rounds = [{"runs": [bad], "offline": None, "summary": {}} for _ in range(2)]
    runs, offline = compare.merge_rounds(["naive"], rounds)
    assert runs[0]["error"] == "no start" and offline is None


def test_targets_are_judged_against_the_stated_bounds():
    rounds = [_round(1.0), _round(2.0), _round(0.5)]
    runs, offline = compare.merge_rounds(["diffserve-b1", "diffserve"], rounds)
    summary = compare.combine_summaries(_args(), runs, offline, rounds)
    verdicts = {name: (value, met) for name, value, _, met in compare.targets(summary, "cpu")}
    assert verdicts["saturated / offline B=max"] == (pytest.approx(30 / 33), True)  # >= 0.85
    assert verdicts["batching gain served"] == (pytest.approx(3.0), True)  # >= 0.9 x 3.0
    assert verdicts["idle overhead, ms"] == (pytest.approx(12.0), False)  # > 5 ms
    # A GPU is held to 0.95 of its ceiling.
    on_gpu = {name: met for name, _, _, met in compare.targets(summary, "cuda:0")}
    assert on_gpu["saturated / offline B=max"] is False
    text = compare.format_tables(_args(), runs, offline, summary)
    assert "idle overhead, ms" in text and "MISSED" in text
    # Nothing measured: no verdict rather than a pass.
    assert all(met is None for *_, met in compare.targets({}, None))
