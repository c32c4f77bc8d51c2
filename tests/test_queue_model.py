"""benchmarks/queue_model.py: the two modes' rules on hand-made arrivals (no server, no clock)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
qm = pytest.importorskip("queue_model")

FLAT = qm.cost_curve({1: 0.01, 8: 0.01})  # 10 ms a step whatever the batch


def test_cost_curve_interpolates_and_extends():
    cost = qm.cost_curve({1: 0.010, 3: 0.020, 8: 0.045})
    assert cost(1) == pytest.approx(0.010)
    assert cost(2) == pytest.approx(0.015)
    assert cost(8) == pytest.approx(0.045)
    assert cost(10) == pytest.approx(0.055)  # the last segment, extended
    assert qm.cost_curve({4: 0.02})(2) == pytest.approx(0.01)  # one point: proportional


def test_request_mode_makes_a_late_arrival_wait_for_the_running_batch():
    jobs = [(0.0, 10), (0.002, 10), (0.020, 10)]
    # Jobs 0 and 1 share a batch after the 8 ms delay (8-108 ms); job 2 came after it started.
    latency = qm.request_mode(jobs, FLAT, max_batch=8, delay=0.008)
    assert latency[:2] == pytest.approx([0.108, 0.106])
    assert latency[2] == pytest.approx(0.208 - 0.020)


def test_step_mode_admits_at_the_next_step_boundary():
    jobs = [(0.0, 10), (0.015, 10)]
    latency = qm.step_mode(jobs, FLAT, max_batch=8, delay=0.008)
    assert latency[0] == pytest.approx(0.108)
    # Steps end at 18, 28, ... ms: job 1 joins at 18 ms and runs its own 10 steps.
    assert latency[1] == pytest.approx(0.118 - 0.015)


def test_a_short_request_leaves_before_a_long_one_in_step_mode_only():
    jobs = [(0.0, 30), (0.020, 5)]
    step = qm.step_mode(jobs, FLAT, max_batch=8, delay=0.0)
    request = qm.request_mode(jobs, FLAT, max_batch=8, delay=0.0)
    assert step[1] < 0.1 < request[1]
    assert step[1] + jobs[1][0] < step[0]


def test_the_running_set_is_bounded_and_the_queue_is_fifo():
    jobs = [(0.0, 4)] * 3 + [(0.001, 4)]
    latency = qm.step_mode(jobs, FLAT, max_batch=2, delay=0.0)
    assert latency[:2] == pytest.approx([0.04, 0.04])
    assert latency[2] == pytest.approx(0.08) and latency[3] == pytest.approx(0.08 - 0.001)


def test_main_reports_both_modes_per_load(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert qm.main(["--step-ms", "1:15,8:42", "--steps", "20", "--loads", "50,80", "--requests", "200",
                    "--seeds", "2", "--output-file", str(out)]) == 0
    import json

    report = json.loads(out.read_text())
    assert set(report["loads"]) == {"50", "80"}
    for row in report["loads"].values():
        assert 0 < row["request_p50_s"] <= row["request_p99_s"]
        assert 0 < row["step_p50_s"] <= row["step_p99_s"]
    assert 0 < report["mixed"]["ratio"] < 1
    assert "| 50% |" in capsys.readouterr().out
