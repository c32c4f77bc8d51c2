"""Prometheus metrics of a server's processes.

The scheduler and the executors are processes of their own; prometheus-client's multiprocess
mode keeps their values in files under one directory per server, and ``/metrics`` on the
frontend sums them. Each of those processes calls :func:`record_to` first thing at its start,
before prometheus-client is imported there (the library reads the directory from the environment
at import), then makes its one :class:`ProcessMetrics` and hands it to what counts. The frontend's own figures (requests by outcome, latency) live in a private registry of
its process, so a host process (a Ray Serve replica) keeps its other metrics exactly as they were:
nothing here changes the environment or the library's state of the process that hosts the
frontend.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from diffserve.config.flags import NO_ADAPTER, OTHER_ADAPTERS

ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024)
_COST_BUCKETS = (0.25, 0.5, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 8192, 16_384, 32_768, 65_536, 131_072, 262_144)
_FRACTION_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8)
# Distinct sizes the per-size step counter keeps apart.
SIZE_LABELS = 16
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_HOST_BUCKETS = (0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1)
CACHE_OUTCOMES = ("hit", "miss")
WEIGHT_OUTCOMES = ("applied", "refused", "failed")
STAGES = ("encode", "decode")  # the step engine's stages (diffserve.executor.step.stages)
COMPILE_PHASES = ("startup", "serving")

# Distinct adapter names the per-adapter request counter keeps apart.
LORA_LABELS = 64
# Distinct priority classes the per-class figures keep apart (the rest count as "other").
PRIORITY_LABELS = 16

# How a request ended, as the frontend counts it (an item's end is diffserve.wire.protocol.ITEM_OUTCOMES).
REQUEST_OUTCOMES = ("success", "invalid", "rejected", "failed", "cancelled")


def prepare_directory() -> str:
    """A fresh, empty directory for one server's metric files (the engine's processes write
    there; see :func:`record_to`)."""
    return tempfile.mkdtemp(prefix="diffserve-metrics-")


def record_to(path: str) -> None:
    """In an engine process, before any metric exists: write metric values to ``path``."""
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before the process chose where its "
                           "metrics go")
    os.environ[ENV] = path


def remove_directory(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class BoundedLabels:
    """Label values chosen by clients (adapter names, priority classes), kept apart up to a bound
    and counted as "other" past it, so that the series stay bounded."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.seen: set[str] = set()

    def label(self, value) -> str:
        value = str(value)
        if value not in self.seen and len(self.seen) >= self.bound:
            return OTHER_ADAPTERS
        self.seen.add(value)
        return value


class FrontendMetrics:
    """What the frontend itself observes, in a registry of its own process."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.requests_total = Counter(
            "diffserve_requests", "Finished image requests by outcome: success, invalid (4xx), "
            "rejected (429, queue full), failed (5xx), cancelled (the client went away).", ["status"],
            registry=self.registry)
        for status in REQUEST_OUTCOMES:
            self.requests_total.labels(status=status)
        self.request_latency_seconds = Histogram(
            "diffserve_request_latency_seconds", "Time from accepting a request to answering it.",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.class_latency_seconds = Histogram(
            "diffserve_class_request_latency_seconds", "Time from accepting a request to answering "
            f"it, by its priority class (past {PRIORITY_LABELS} classes, \"other\").",
            ["priority"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._classes = BoundedLabels(PRIORITY_LABELS)
        self.lora_requests_total = Counter(
            "diffserve_lora_requests", "Accepted image requests by LoRA adapter (a request "
            f"counts once for each adapter it stacks; past the first {LORA_LABELS} names, the "
            "rest count as \"other\").", ["adapter"], registry=self.registry)
        # A bound on the series, whatever names come and go at run time.
        self._adapter_labels = BoundedLabels(LORA_LABELS)
        self.video = VideoMetrics(self.registry)  # zero unless the model makes videos

    def adapters_used(self, names) -> None:
        """A request's adapters (none: it counts as adapter="none", the base model alone)."""
        for name in list(names) or [NO_ADAPTER]:
            self.lora_requests_total.labels(adapter=self._adapter_labels.label(name)).inc()

    def finished(self, outcome: str, seconds: float, priority: int | None = None) -> None:
        """One request's answer: the one place its outcome and latency are counted (by class
        too, once it has one: a request refused before validation has none)."""
        self.requests_total.labels(status=outcome).inc()
        self.request_latency_seconds.observe(seconds)
        if priority is not None:
            self.class_latency_seconds.labels(priority=self._classes.label(priority)).observe(seconds)


class ProcessMetrics:
    """What the scheduler and the executors observe, summed over their processes."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        if not os.environ.get(ENV):
            raise RuntimeError("engine metrics need record_to(directory) at process start")
        ex = ["executor"]
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
        self.non_finite_outputs_total = Counter(
            "diffserve_non_finite_outputs", "Requests failed because an image came out with NaN "
            "or infinite pixels (a model overflowing its dtype), answered 500 non_finite_output "
            "instead of a black image.", ex)
        self.class_queue_time_seconds = Histogram(
            "diffserve_class_queue_time_seconds", "Queue time (arrival to first dispatch) by the "
            f"request's priority class (past {PRIORITY_LABELS} classes, the rest count as "
            "\"other\").", ["priority"], buckets=_LATENCY_BUCKETS)
        self.sleeping = Gauge(
            "diffserve_sleeping", "The level the server sleeps at (POST /v1/sleep: 1 weights "
            "in host memory, 2 dropped); 0 while awake.", multiprocess_mode="livemax")
        self.queue_held = Gauge(
            "diffserve_queue_held", "1 while a weight update or a sleep holds the queue (new "
            "requests wait; running ones finish or, for an update in abort mode, end).",
            multiprocess_mode="livemax")
        self.weight_updates_total = Counter(
            "diffserve_weight_updates", "POST /v1/update_weights by outcome: applied, refused "
            "(the update did not fit, or another was under way), failed.", ["outcome"])
        self.weight_update_seconds = Histogram(
            "diffserve_weight_update_seconds", "An applied weight update, from its request to "
            "every executor holding it (the drain of running work included).",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.num_requests_paused = Gauge(
            "diffserve_num_requests_paused", "Step mode: request items paused to make room for "
            "better priority classes, waiting to resume.", multiprocess_mode="livesum")
        self.preemptions_total = Counter(
            "diffserve_preemptions", "Step mode: request items paused at a step boundary to make "
            "room for a request of a better priority class (--scheduling-policy priority).",
            ["executor"])
        self.requests_cancelled_total = Counter(
            "diffserve_requests_cancelled", "Requests dropped because their client went away.")
        self.batches_interrupted_total = Counter(
            "diffserve_batches_interrupted", "Request mode: pipeline calls stopped early because "
            "every caller had gone.", ex)
        self.executor_restarts_total = Counter(
            "diffserve_executor_restarts", "Times an executor process was restarted after dying.", ex)
        self.step_stall_seconds = Counter(
            "diffserve_step_stall_seconds", "Step mode: time the step loop waited for a stage "
            "(encode: prompts, input images; decode: finished images, previews), or ran its work "
            "itself where the stages are off.", ex + ["stage"])
        self.stage_busy_seconds = Counter(
            "diffserve_stage_busy_seconds", "Step mode: time a stage worked.", ex + ["stage"])
        self.stage_queue_depth = Gauge(
            "diffserve_stage_queue_depth", "Step mode: jobs a stage holds (waiting, running, done "
            "and not taken back).", ex + ["stage"], multiprocess_mode="livesum")
        self.prompt_cache_requests_total = Counter(
            "diffserve_prompt_cache_requests", "Prompt encodings looked up in the prompt cache: "
            "hit, or miss (encoded).", ex + ["outcome"])
        self.memory_budget_bytes = Gauge(
            "diffserve_memory_budget_bytes", "The executor's memory budget (--device-memory-bytes, "
            "--gpu-memory-utilization); 0: none.", ex, multiprocess_mode="livesum")
        self.memory_admitted_bytes = Gauge(
            "diffserve_memory_admitted_bytes", "What the executor holds (weights, buffers) and what "
            "the work it runs now takes, by the measured bytes per unit of cost.", ex,
            multiprocess_mode="livesum")
        self.group_restarts_total = Counter(
            "diffserve_group_restarts", "Times a parallel group was restarted whole (a rank died "
            "or a collective timed out).", ex)
        self.group_ranks = Gauge(
            "diffserve_group_ranks", "Ranks (processes, devices) of the executor: 1, or its "
            "parallel group's size.", ex, multiprocess_mode="livemax")
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

        self.step_host_seconds = Histogram(
            "diffserve_step_host_seconds", "Step mode: the part of one step spent outside the "
            "denoiser and the VAE (stacking inputs, guidance, each request's sampler step, "
            "bookkeeping).", ex, buckets=_HOST_BUCKETS)

        # Accelerators.
        self.step_cache_rows_total = Counter(
            "diffserve_step_cache_rows", "--step-cache: denoiser rows by outcome: hit (reused its "
            "image's cache and skipped the blocks after the first) or miss (computed them).",
            ["executor", "outcome"])
        self.step_cache_bytes = Gauge(
            "diffserve_step_cache_bytes", "--step-cache: bytes the running requests' step caches "
            "hold.", ex, multiprocess_mode="livesum")
        self.compiles_total = Counter(
            "diffserve_compiles", "--compile: graphs torch.compile built, at start-up or while "
            "serving (a shape or bucket first seen then; flat in steady state).",
            ["executor", "when"])
        self.model_flops_total = Counter(
            "diffserve_model_flops", "The model's FLOPs the denoiser forwards computed (every "
            "matmul, convolution and attention product, as fitted at start; a parallel group's "
            "ranks together).", ex)
        self.model_flops_utilization = Gauge(
            "diffserve_model_flops_utilization", "Model FLOPs utilisation while busy: the model's "
            "FLOPs over the last 10 s of device time, against the device's peak (--device-peak-"
            "tflops or the table of GPUs); absent where the peak is unknown.", ex,
            multiprocess_mode="livemax")

        # Several sizes at once (step mode).
        self.running_sets = Gauge(
            "diffserve_running_sets", "Step mode: running sets the executor holds (one per size "
            "in flight).", ex, multiprocess_mode="livemax")
        self.forward_cost = Histogram(
            "diffserve_forward_cost", "Step mode: cost one denoiser forward carried, in rows at "
            "the model's native size (see --max-batch-cost).", ex, buckets=_COST_BUCKETS)
        self.steps_total = Counter(
            "diffserve_steps", "Step mode: denoising steps by the size of the set they advanced "
            "(\"mixed\" where its rows' sizes differ; past 16 sizes, the rest count as "
            "\"other\").", ["executor", "size"])
        self.forward_tokens = Histogram(
            "diffserve_forward_tokens", "Step mode: image tokens one denoiser forward carried, "
            "every row's own (a UNet's: latent cells), padding aside.", ex, buckets=_TOKEN_BUCKETS)
        self.forward_padding = Histogram(
            "diffserve_forward_padding_fraction", "Step mode: of the image tokens one forward "
            "computed, the share that padded rows of smaller sizes to the longest row's (0 where "
            "its rows share a size).", ex, buckets=_FRACTION_BUCKETS)
        self.set_waits_total = Counter(
            "diffserve_set_waits", "Step mode: requests at the head of the queue that had to wait "
            "because no executor had running-cost room for them (--max-running-cost).")

        # LoRA adapters.
        self.loras_resident = Gauge(
            "diffserve_loras_resident", "LoRA adapter versions loaded in the executor (at most "
            "--max-loras, beyond it only while every one is held by a running request).", ex,
            multiprocess_mode="livemax")
        self.lora_loads_total = Counter(
            "diffserve_lora_loads", "LoRA adapters loaded into the executor (at start, at run "
            "time, or again after an eviction).", ex)
        self.lora_unloads_total = Counter(
            "diffserve_lora_unloads", "LoRA adapters unloaded at run time.", ex)
        self.lora_evictions_total = Counter(
            "diffserve_lora_evictions", "LoRA adapters unloaded to make room (--max-loras).", ex)
        self.lora_load_seconds = Histogram(
            "diffserve_lora_load_seconds", "Time to load and check one LoRA adapter.", ex,
            buckets=_LATENCY_BUCKETS)

    def declare_executor(self, index: int) -> None:
        """Create executor ``index``'s series at zero, so that dashboards and alert rules see
        them before the first event (a series that does not exist cannot be alerted on)."""
        from diffserve.wire.protocol import DISPATCH_REASONS, ITEM_OUTCOMES

        label = str(index)
        for metric in (self.batch_size, self.batch_execution_seconds, self.executor_busy_seconds,
                       self.preemptions_total,
                       self.images_generated_total, self.partial_images_total,
                       self.non_finite_outputs_total, self.batches_interrupted_total, self.executor_restarts_total,
                       self.group_restarts_total,
                       self.step_seconds, self.step_running_images, self.step_admissions_total,
                       self.forward_cost, self.forward_tokens, self.forward_padding,
                       self.model_flops_total, self.lora_loads_total, self.lora_unloads_total, self.lora_evictions_total,
                       self.lora_load_seconds):
            metric.labels(executor=label)
        for reason in DISPATCH_REASONS:
            self.dispatches_total.labels(reason=reason, executor=label)
        for outcome in ITEM_OUTCOMES:
            self.step_retirements_total.labels(executor=label, outcome=outcome)
        for outcome in CACHE_OUTCOMES:
            self.step_cache_rows_total.labels(executor=label, outcome=outcome)
            self.prompt_cache_requests_total.labels(executor=label, outcome=outcome)
        for stage in STAGES:
            self.step_stall_seconds.labels(executor=label, stage=stage)
            self.stage_busy_seconds.labels(executor=label, stage=stage)
            self.stage_queue_depth.labels(executor=label, stage=stage).set(0)
        for phase in COMPILE_PHASES:
            self.compiles_total.labels(executor=label, when=phase)
        self.step_host_seconds.labels(executor=label)
        self.step_cache_bytes.labels(executor=label).set(0)
        self.executor_ready.labels(executor=label).set(0)
        self.running_sets.labels(executor=label).set(0)
        self.loras_resident.labels(executor=label).set(0)


def render(directory: str, frontend: FrontendMetrics) -> tuple[bytes, str]:
    """The exposition text: the engine's processes' figures summed, then the frontend's."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)
    return generate_latest(registry) + generate_latest(frontend.registry), CONTENT_TYPE_LATEST


def process_died(pid: int) -> None:
    """Drop a dead process's live gauges."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)


VIDEO_STATUSES = ("queued", "in_progress", "completed", "failed")
_VIDEO_BUCKETS = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)


class VideoMetrics:
    """The video jobs of a frontend that serves a video model, in the frontend's registry."""

    def __init__(self, registry) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.jobs = Gauge("diffserve_video_jobs", "Video jobs held, by status (failed and completed "
                          "ones until they expire or are deleted).", ["status"], registry=registry)
        for status in VIDEO_STATUSES:
            self.jobs.labels(status=status)
        self.finished_total = Counter(
            "diffserve_video_jobs_finished", "Video jobs that ended, by status: completed, failed, "
            "cancelled (deleted while queued or running).", ["status"], registry=registry)
        for status in ("completed", "failed", "cancelled"):
            self.finished_total.labels(status=status)
        self.video_seconds_total = Counter(
            "diffserve_video_seconds_generated", "Seconds of video made (frames / fps) by "
            "completed jobs.", registry=registry)
        self.queue_seconds = Histogram(
            "diffserve_video_queue_seconds", "A video job's time from creation to its first "
            "denoising step.", buckets=_VIDEO_BUCKETS, registry=registry)
        self.run_seconds = Histogram(
            "diffserve_video_run_seconds", "A completed video job's time from its first denoising "
            "step to its files being stored (decode and encode included).",
            buckets=_VIDEO_BUCKETS, registry=registry)
