"""benchmarks/server_metrics.py: what two /metrics snapshots say about a run (pure functions on
exposition text, no server)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
server_metrics = pytest.importorskip("server_metrics")


def snapshot(batches: list[int], queue_s: float, exec_s: float, request_exec_s: float,
             latency_s: float, requests: int) -> dict:
    """Exposition text as the server writes it after ``batches`` (images per call)."""
    lines = ["# HELP diffserve_batch_size Images per executor call.",
             "# TYPE diffserve_batch_size histogram"]
    for le in ("1.0", "2.0", "4.0", "8.0", "+Inf"):
        bound = float("inf") if le == "+Inf" else float(le)
        lines.append(f'diffserve_batch_size_bucket{{le="{le}"}} {sum(b <= bound for b in batches)}')
    lines += [f"diffserve_batch_size_count {len(batches)}", f"diffserve_batch_size_sum {sum(batches)}",
              f"diffserve_queue_time_seconds_sum {queue_s}",
              f"diffserve_queue_time_seconds_count {requests}",
              f"diffserve_batch_execution_seconds_sum {exec_s}",
              f"diffserve_batch_execution_seconds_count {len(batches)}",
              f"diffserve_request_execution_seconds_sum {request_exec_s}",
              f"diffserve_request_execution_seconds_count {requests}",
              f"diffserve_request_latency_seconds_sum {latency_s}",
              f"diffserve_request_latency_seconds_count {requests}",
              f'diffserve_requests_total{{status="success"}} {requests}',
              f'diffserve_requests_total{{status="failed"}} 0']
    return server_metrics.parse_prometheus("\n".join(lines))


def test_the_change_between_snapshots_describes_only_the_run():
    before = snapshot([1, 1], queue_s=0.02, exec_s=0.2, request_exec_s=0.2, latency_s=0.25,
                      requests=2)
    # The run: one call of 8 (0.8 s) and one of 4 (0.5 s) for 12 single-image requests.
    after = snapshot([1, 1, 8, 4], queue_s=0.02 + 12 * 0.1, exec_s=0.2 + 1.3,
                     request_exec_s=0.2 + 8 * 0.8 + 4 * 0.5, latency_s=0.25 + 12 * 0.8,
                     requests=14)
    d = server_metrics.metrics_delta(before, after, duration_s=2.0, client_mean_latency_s=0.81)
    assert d["batches"] == 2 and d["mean_batch_size"] == 6
    assert d["batch_size_histogram"] == {"4.0": 1, "8.0": 1}
    assert d["mean_queue_time_s"] == pytest.approx(0.1)
    assert d["mean_batch_execution_s"] == pytest.approx(0.65)
    assert d["executor_busy_fraction"] == pytest.approx(1.3 / 2.0)
    assert d["requests_by_status"] == {"failed": 0, "success": 12}
    # Per request: 0.8 s at the frontend = 0.1 queued + 0.7 in its calls (8 x 0.8 and 4 x 0.5
    # over 12) + 0 server overhead; the client saw 10 ms more.
    assert d["mean_request_execution_s"] == pytest.approx(0.7)
    assert d["mean_server_overhead_s"] == pytest.approx(0.0, abs=1e-9)
    assert d["mean_client_and_http_s"] == pytest.approx(0.01)


def test_no_snapshot_no_figures():
    assert server_metrics.metrics_delta(None, {}, 1.0) is None
