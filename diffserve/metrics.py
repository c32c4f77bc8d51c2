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
import sys
import tempfile

ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


def prepare_directory() -> str:
    """A fresh, empty directory for this server's metric files, exported in the environment
    (spawned children inherit it). Call before the first metric is created."""
    path = tempfile.mkdtemp(prefix="diffserve-metrics-")
    os.environ[ENV] = path
    if "prometheus_client" in sys.modules:
        # A host process (a Ray Serve replica) imported prometheus_client first, when it chose
        # in-memory values; metrics created from now on must write to the directory instead.
        from prometheus_client import values

        values.ValueClass = values.get_value_class()
    return path


def remove_directory(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class _Metrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        ex = ["executor"]
        self.requests_total = Counter(
            "diffserve_requests", "Finished image requests by outcome: success, invalid (4xx), "
            "rejected (429, queue full), failed (5xx), cancelled (the client went away).", ["status"])
        for status in ("success", "invalid", "rejected", "failed", "cancelled"):
            self.requests_total.labels(status=status)
        self.num_requests_waiting = Gauge(
            "diffserve_num_requests_waiting", "Requests waiting in the queue.",
            multiprocess_mode="livesum")
        self.num_requests_running = Gauge(
            "diffserve_num_requests_running", "Requests some executor is working on.",
            multiprocess_mode="livesum")
        self.max_queue_size = Gauge(
            "diffserve_max_queue_size", "--max-queue-size (0: unbounded).",
            multiprocess_mode="livemax")
        self.batching_mode = Gauge(
            "diffserve_batching_mode", "1 for the batching mode the executors run (step or request).",
            ["mode"], multiprocess_mode="livemax")
        self.executor_ready = Gauge(
            "diffserve_executor_ready", "1 while the executor has its model loaded and serves.",
            ex, multiprocess_mode="livemax")
        self.batch_size = Histogram(
            "diffserve_batch_size", "Images per dispatch to an executor: a batch (request mode) or "
            "an admission into a running set (step mode).", ex, buckets=_BATCH_BUCKETS)
        self.dispatches_total = Counter(
            "diffserve_dispatches", "Dispatches to executors by why they left the queue: full, "
            "delay (the oldest waited --dynamic-batch-delay-ms), executor_free (the delay had "
            "passed while every executor was busy), drain (shutdown), join (step mode: company for "
            "a running set).", ["reason", "executor"])
        self.queue_time_seconds = Histogram(
            "diffserve_queue_time_seconds", "Time from arrival at the scheduler to the first "
            "dispatch of a request.", buckets=_LATENCY_BUCKETS)
        self.request_latency_seconds = Histogram(
            "diffserve_request_latency_seconds", "Time from accepting a request to answering it.",
            buckets=_LATENCY_BUCKETS)
        self.request_execution_seconds = Histogram(
            "diffserve_request_execution_seconds", "Time of the pipeline calls or denoising steps "
            "that produced a successful request's images (summed over its parts).",
            buckets=_LATENCY_BUCKETS)
        self.batch_execution_seconds = Histogram(
            "diffserve_batch_execution_seconds", "Request mode: time of one batched pipeline call.",
            ex, buckets=_LATENCY_BUCKETS)
        self.executor_busy_seconds = Counter(
            "diffserve_executor_busy_seconds", "Time the executor spent computing (pipeline calls, "
            "or admissions, steps and decodes); its rate is the busy share.", ex)
        self.images_generated_total = Counter(
            "diffserve_images_generated", "Images produced by the executor.", ex)
        self.partial_images_total = Counter(
            "diffserve_partial_images", "Streamed partial images decoded by the executor.", ex)
        self.requests_cancelled_total = Counter(
            "diffserve_requests_cancelled", "Requests dropped because their client went away.")
        self.batches_interrupted_total = Counter(
            "diffserve_batches_interrupted", "Request mode: pipeline calls stopped early because "
            "every caller had gone.", ex)
        self.executor_restarts_total = Counter(
            "diffserve_executor_restarts", "Times an executor process was restarted after dying.", ex)
        # Step mode.
        self.step_seconds = Histogram(
            "diffserve_step_seconds", "Step mode: one denoising step of the running set (one "
            "batched forward and every sample's scheduler step).", ex, buckets=_STEP_BUCKETS)
        self.step_running_images = Histogram(
            "diffserve_step_running_images", "Step mode: images carried by one denoising forward.",
            ex, buckets=_BATCH_BUCKETS)
        self.step_admissions_total = Counter(
            "diffserve_step_admissions", "Step mode: requests (or parts of one) admitted into the "
            "running set.", ex)
        self.step_retirements_total = Counter(
            "diffserve_step_retirements", "Step mode: requests (or parts of one) that left the "
            "running set, by outcome: finished, cancelled, failed.", ["executor", "outcome"])

    def declare_executor(self, index: int) -> None:
        """Create executor ``index``'s series at zero, so that dashboards and alert rules see
        them before the first event (a series that does not exist cannot be alerted on)."""
        from diffserve.executor.results import OUTCOMES
        from diffserve.scheduler.core import DISPATCH_REASONS

        label = str(index)
        for metric in (self.batch_size, self.batch_execution_seconds, self.executor_busy_seconds,
                       self.images_generated_total, self.partial_images_total,
                       self.batches_interrupted_total, self.executor_restarts_total,
                       self.step_seconds, self.step_running_images, self.step_admissions_total):
            metric.labels(executor=label)
        for reason in DISPATCH_REASONS:
            self.dispatches_total.labels(reason=reason, executor=label)
        for outcome in OUTCOMES:
            self.step_retirements_total.labels(executor=label, outcome=outcome)
        self.executor_ready.labels(executor=label).set(0)


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
