"""benchmarks/kit/server_metrics.py's /metrics reading: what two snapshots, summed over servers,
say about a run (pure functions on synthetic exposition text, no server)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
server_metrics = pytest.importorskip("kit.server_metrics")


def exposition(dispatches: list[int], queue_s: float, busy_s: float, request_exec_s: float,
               latency_s: float, requests: int, executor: str = "0", mode: str = "step") -> str:
    """Exposition text as one diffserve server writes it, after ``dispatches`` (images each)."""
    ex = f'executor="{executor}"'
    lines = ["# HELP diffserve_batch_size Images per dispatch.", "# TYPE diffserve_batch_size histogram"]
    for le in ("1.0", "2.0", "4.0", "8.0", "+Inf"):
        bound = float(le)
        lines.append(f'diffserve_batch_size_bucket{{{ex},le="{le}"}} {sum(b <= bound for b in dispatches)}')
    lines += [f"diffserve_batch_size_count{{{ex}}} {len(dispatches)}",
              f"diffserve_batch_size_sum{{{ex}}} {sum(dispatches)}",
              "# TYPE diffserve_dispatches counter",
              f'diffserve_dispatches_total{{{ex},reason="full"}} {sum(b == 8 for b in dispatches)}',
              f'diffserve_dispatches_total{{{ex},reason="delay"}} {sum(b < 8 for b in dispatches)}',
              "# TYPE diffserve_executor_busy_seconds counter",
              f"diffserve_executor_busy_seconds_total{{{ex}}} {busy_s}",
              "# TYPE diffserve_images_generated counter",
              f"diffserve_images_generated_total{{{ex}}} {sum(dispatches)}",
              "# TYPE diffserve_executor_ready gauge", f"diffserve_executor_ready{{{ex}}} 1.0",
              "# TYPE diffserve_batching_mode gauge",
              *(f'diffserve_batching_mode{{mode="{m}"}} {float(m == mode)}' for m in ("request", "step")),
              "# TYPE diffserve_requests counter",
              f'diffserve_requests_total{{status="success"}} {requests}',
              'diffserve_requests_total{status="failed"} 0.0']
    for name, total in (("queue_time", queue_s), ("request_execution", request_exec_s),
                        ("request_latency", latency_s)):
        lines += [f"# TYPE diffserve_{name}_seconds histogram",
                  f'diffserve_{name}_seconds_bucket{{le="+Inf"}} {requests}',
                  f"diffserve_{name}_seconds_sum {total}", f"diffserve_{name}_seconds_count {requests}"]
    return "\n".join(lines) + "\n"


def test_the_change_between_snapshots_describes_only_the_run():
    before = server_metrics.parse_metrics(exposition([1, 1], queue_s=0.02, busy_s=0.2, request_exec_s=0.2,
                                                        latency_s=0.25, requests=2))
    # The run: one dispatch of 8 and one of 4 (1.3 s busy) for 12 single-image requests.
    after = server_metrics.parse_metrics(exposition([1, 1, 8, 4], queue_s=0.02 + 12 * 0.1, busy_s=0.2 + 1.3,
                                                       request_exec_s=0.2 + 12 * 0.7, latency_s=0.25 + 12 * 0.8,
                                                       requests=14))
    d = server_metrics.metrics_delta(before, after, duration_s=2.0, client_mean_latency_s=0.81)
    assert d["batching_mode"] == "step" and d["executors"] == 1
    assert d["dispatches"] == 2 and d["mean_batch_size"] == 6
    assert d["dispatches_by_reason"] == {"full": 1, "delay": 1}
    assert d["images_generated"] == 12
    assert d["requests_by_status"] == {"success": 12}
    assert d["mean_queue_time_s"] == pytest.approx(0.1)
    assert d["executor_busy_fraction"] == pytest.approx(1.3 / 2.0)
    # Per request: 0.8 s at the frontend = 0.1 queued + 0.7 executing + 0 server overhead; the
    # client saw 10 ms more.
    assert d["mean_request_execution_s"] == pytest.approx(0.7)
    assert d["mean_server_overhead_s"] == pytest.approx(0.0, abs=1e-9)
    assert d["mean_client_and_http_s"] == pytest.approx(0.01)
    assert d["mean_batch_execution_s"] is None  # a request-mode figure


def test_snapshots_of_several_servers_are_summed():
    one = exposition([8, 8], queue_s=0.2, busy_s=1.0, request_exec_s=1.6, latency_s=2.0, requests=16)
    two = exposition([4], queue_s=0.1, busy_s=0.6, request_exec_s=0.4, latency_s=0.6, requests=4)
    summed = server_metrics.parse_metrics(two, server_metrics.parse_metrics(one))
    assert server_metrics.total(summed, "diffserve_batch_size_count") == 3
    assert server_metrics.total(summed, "diffserve_requests_total", status="success") == 20
    empty = server_metrics.parse_metrics(exposition([], 0, 0, 0, 0, 0))
    d = server_metrics.metrics_delta(empty, summed, duration_s=1.0)
    assert d["dispatches"] == 3 and d["mean_batch_size"] == pytest.approx(20 / 3)
    # Two executors (one per server) busy 1.6 s of 2 executor-seconds.
    assert d["executors"] == 2 and d["executor_busy_fraction"] == pytest.approx(0.8)
    assert d["mean_request_execution_s"] == pytest.approx(2.0 / 20)
    assert d["mean_client_and_http_s"] is None  # no client latency given


def test_labels_are_matched_not_guessed():
    samples = server_metrics.parse_metrics('# TYPE x counter\nx_total{a="1",b="2"} 3\nx_total{a="1",b="3"} 4\n')
    assert server_metrics.total(samples, "x_total") == 7
    assert server_metrics.total(samples, "x_total", b="3") == 4
    assert server_metrics.total(samples, "x_total", a="2") is None


def test_no_snapshot_no_figures():
    assert server_metrics.metrics_delta(None, {}, 1.0) is None
