"""Prometheus metrics, shared by all of the server's processes.

prometheus-client's multiprocess mode keeps each process's values in files under one directory
(``PROMETHEUS_MULTIPROC_DIR``), and the frontend's ``/metrics`` sums them, so figures observed in
the scheduler and the executor show there. The directory must be set in the environment before
``prometheus_client`` is first imported: :func:`prepare_directory` does that in the server's main
process and spawned children inherit it.
"""

from __future__ import annotations

import os
import shutil
import tempfile

ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024)


def prepare_directory() -> str:
    """A fresh, empty directory for this server's metric files, exported in the environment."""
    if "prometheus_client" in __import__("sys").modules and not os.environ.get(ENV):
        raise RuntimeError("prometheus_client was imported before the metrics directory was set")
    path = tempfile.mkdtemp(prefix="diffserve-metrics-")
    os.environ[ENV] = path
    return path


def remove_directory(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class _Metrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.requests_total = Counter(
            "diffserve_requests", "Finished image requests by outcome: success, invalid (4xx), "
            "rejected (429, queue full), failed (5xx), cancelled (the client went away).", ["status"])
        for status in ("success", "invalid", "rejected", "failed", "cancelled"):
            self.requests_total.labels(status=status)
        self.num_requests_waiting = Gauge(
            "diffserve_num_requests_waiting", "Requests waiting for a batch.",
            multiprocess_mode="livesum")
        self.num_requests_running = Gauge(
            "diffserve_num_requests_running", "Requests in the batch the executor is running.",
            multiprocess_mode="livesum")
        self.batch_size = Histogram(
            "diffserve_batch_size", "Images per executor call.", buckets=_BATCH_BUCKETS)
        self.queue_time_seconds = Histogram(
            "diffserve_queue_time_seconds", "Time from arrival at the scheduler to the first "
            "dispatch of a request.", buckets=_LATENCY_BUCKETS)
        self.request_latency_seconds = Histogram(
            "diffserve_request_latency_seconds", "Time from accepting a request to answering it.",
            buckets=_LATENCY_BUCKETS)
        self.request_execution_seconds = Histogram(
            "diffserve_request_execution_seconds", "Time of the pipeline calls that produced a "
            "successful request's images (summed when its n images took several calls).",
            buckets=_LATENCY_BUCKETS)
        self.batch_execution_seconds = Histogram(
            "diffserve_batch_execution_seconds", "Time of one batched pipeline call.",
            buckets=_LATENCY_BUCKETS)
        self.images_generated_total = Counter(
            "diffserve_images_generated", "Images produced by the executor.")
        self.requests_cancelled_total = Counter(
            "diffserve_requests_cancelled", "Requests dropped by the scheduler because their "
            "client went away.")
        self.batches_interrupted_total = Counter(
            "diffserve_batches_interrupted", "Batches stopped early because every caller had gone.")
        self.executor_restarts_total = Counter(
            "diffserve_executor_restarts", "Times the executor process was restarted after dying.")


_instance: _Metrics | None = None


def metrics() -> _Metrics:
    global _instance
    if _instance is None:
        _instance = _Metrics()
    return _instance


def render() -> tuple[bytes, str]:
    """The exposition text summed over every process of this server."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return generate_latest(registry), CONTENT_TYPE_LATEST


def process_died(pid: int) -> None:
    """Drop a dead process's live gauges."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)
