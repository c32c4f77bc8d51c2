"""benchmarks/compare.py's arithmetic: medians over rounds, ratios, target verdicts and the table
(pure functions on synthetic rounds, no server)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
compare = pytest.importorskip("compare")
stats = pytest.importorskip("kit.stats")
servers = pytest.importorskip("kit.servers")

TARGETS = compare.SCENARIOS["modes"].targets
SATURATED = "saturated img/s, step/request"
P99_50 = "p99 ms @50%, step/request"
IDLE_STEP = "idle overhead ms, step"


def test_median_ratio_and_judge():
    assert stats.median([3.0, None, 1.0, 2.0]) == 2.0
    assert stats.median([None]) is None
    assert stats.ratio(3.0, 4.0) == 0.75
    assert stats.ratio(None, 4.0) is None and stats.ratio(3.0, 0.0) is None
    assert stats.judge(0.95, ">=", 0.95) is True and stats.judge(0.94, ">=", 0.95) is False
    assert stats.judge(0.7, "<=", 0.7) is True and stats.judge(0.71, "<=", 0.7) is False
    assert stats.judge(None, "<=", 0.7) is None


def test_rounds_become_medians_and_targets_are_judged_on_them():
    # The machine's speed drifted between rounds; the ratios, taken within each round, did not much.
    rounds = [{"saturated img/s, step": 10.0, "saturated img/s, request": 10.0, SATURATED: 1.0,
               P99_50: 0.6, IDLE_STEP: 4.0},
              {"saturated img/s, step": 20.0, "saturated img/s, request": 21.0, SATURATED: 20 / 21,
               P99_50: 0.9, IDLE_STEP: 6.0},
              {"saturated img/s, step": 5.0, "saturated img/s, request": 5.5, SATURATED: 5 / 5.5,
               P99_50: 0.65, IDLE_STEP: None}]
    summary = stats.summarize(rounds, TARGETS)
    assert summary["medians"]["saturated img/s, step"] == 10.0
    assert summary["medians"][SATURATED] == pytest.approx(20 / 21)
    assert summary["by_round"][P99_50] == [0.6, 0.9, 0.65]
    assert summary["medians"][IDLE_STEP] == 5.0  # the round that measured nothing is left out
    verdicts = summary["verdicts"]
    assert verdicts[SATURATED] is True  # 0.952 >= 0.95
    assert verdicts[P99_50] is True  # 0.65 <= 0.7
    assert verdicts[IDLE_STEP] is True  # 5 ms <= 5 ms
    assert verdicts["short mean ms (mixed), step/request"] is None  # never measured

    table = stats.format_table(summary, TARGETS)
    lines = table.splitlines()
    assert lines[0] == "| figure | median | by round | target | verdict |"
    assert f"| {SATURATED} | 0.952 | 1, 0.952, 0.909 | >= 0.95 | met |" in lines
    assert "| short mean ms (mixed), step/request | n/a | | <= 0.5 | not measured |" in lines
    assert "| saturated img/s, request | 10 | 10, 21, 5.5 |  |  |" in lines


def test_a_missed_target_says_so():
    summary = stats.summarize([{P99_50: 0.8}, {P99_50: 0.9}], TARGETS)
    assert summary["verdicts"][P99_50] is False
    assert f"| {P99_50} | 0.85 | 0.8, 0.9 | <= 0.7 | **MISSED** |" in stats.format_table(summary, TARGETS)


class FakeBench:
    """Stands in for kit.servers.Bench: no servers; each load answers synthetic figures and is logged."""

    def __init__(self) -> None:
        self.args = argparse.Namespace(concurrency=32, loads=[50, 80], mixed_steps=[8, 32], steps=None,
                                       default_steps=20, idle_requests=8, batch_delay_ms=8.0)
        self.calls: list[tuple[str, dict]] = []

    @contextlib.contextmanager
    def servers(self, name, *configs):
        yield servers.Served(["http://fake"], True)

    def load(self, served, label: str, **overrides) -> dict:
        self.calls.append((label, overrides))
        step = label.startswith("step")
        lat = {"mean": 0.5, "p50": 0.4, "p99": 1.0}
        if "%" in label:
            lat = {"mean": 0.3, "p50": 0.2 if step else 0.4, "p99": 0.6 if step else 1.0}
        return {"images_per_s": 9.5 if step else 10.0, "requests_per_s": 9.5 if step else 10.0,
                "latency_s": {**lat, "mean": 0.0615 if "idle" in label else lat["mean"]},
                "latency_by_steps_s": {"8": {"mean": 0.1 if step else 0.4}, "32": {"mean": 1.0}},
                "server_metrics": {"mean_request_execution_s": 0.05}}


def test_modes_derives_loads_ratios_and_idle_overhead_from_its_measurements():
    bench = FakeBench()
    f = compare.modes(bench)
    rates = {label: o.get("request_rate") for label, o in bench.calls}
    # Offered loads are shares of request mode's saturated req/s, for both modes.
    assert rates["request 50%"] == rates["step 50%"] == pytest.approx(5.0)
    assert rates["step 80%"] == pytest.approx(8.0)
    # Mixed 8/32 steps (mean 20) at half of a saturation measured at 20 steps: 5 req/s.
    assert rates["step mixed"] == pytest.approx(5.0)
    assert dict(bench.calls)["step mixed"]["mixed_steps"] == [8, 32]
    assert dict(bench.calls)["request idle"] == {"max_concurrency": 1, "num_prompts": 8}
    assert f[SATURATED] == pytest.approx(0.95)
    assert f["p50 ms @50%, step/request"] == pytest.approx(0.5)
    assert f["short mean ms (mixed), step/request"] == pytest.approx(0.25)
    # 61.5 ms at the client - 50 ms executing - 8 ms delay.
    assert f[IDLE_STEP] == pytest.approx(3.5)
    verdicts = stats.summarize([f], TARGETS)["verdicts"]
    assert all(verdicts.values()), verdicts


def test_overhead_takes_the_saturated_and_idle_figures_of_modes():
    bench = FakeBench()
    f = compare.SCENARIOS["overhead"].run(bench)
    assert [label for label, _ in bench.calls] == ["request saturated", "request idle", "step saturated", "step idle"]
    assert set(f) == {f"{name}, {mode}" for mode in ("request", "step")
                      for name in ("saturated img/s", "saturated p99 ms", "idle overhead ms")}
    assert f[IDLE_STEP] == pytest.approx(3.5)
