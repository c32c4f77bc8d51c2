"""An executor's two sockets as its loops see them: messages from and result headers to the
scheduler, pixels and tensors straight to the frontend; and what the loops count."""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from diffserve import metrics
from diffserve.executor.results import NON_FINITE, Outcome
from diffserve.wire.protocol import (
    AdapterResult,
    ItemImages,
    ItemTensors,
    ItemsDone,
    Kind,
    Partial,
    Progress,
    FramesMismatch,
    ProtocolError,
    TensorSpec,
    decode,
    encode,
)

log = logging.getLogger(__name__)

# A request's progress goes to the frontend at most this often (and at its last step): a short
# step must not turn into a message storm.
PROGRESS_INTERVAL_S = 0.25


class ExecutorSockets:
    """The executor's two sockets: messages from and headers to the scheduler, pixels to the
    frontend."""

    def __init__(self, sock: zmq.Socket, pixels: zmq.Socket, index: int,
                 counts: metrics.ProcessMetrics) -> None:
        self.sock, self.pixels = sock, pixels
        self.label = str(index)
        self.metrics = counts
        self._sizes: set[str] = set()
        self._progress_sent: dict[str, float] = {}  # request id -> when its progress last went
        self._compiled = None  # the compiled blocks, whose new graphs are counted
        self._flops = None  # the model's FLOP counter (diffserve.executor.accel.flops)
        self._utilization = None  # and its utilisation, where the device's peak is known

    def receive(self, block: bool, wake: int | None = None) -> tuple[Kind, Any, list[Any]] | None:
        """The next message from the scheduler; None if there is none (not ``block``), or when
        ``wake`` (a file descriptor) became readable first."""
        if wake is not None:
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            poller.register(wake, zmq.POLLIN)
            if self.sock not in dict(poller.poll()):
                return None
            block = False
        try:
            frames = self.sock.recv_multipart(0 if block else zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            return decode(frames)
        except FramesMismatch as error:  # work whose frames are not its items': answer them
            log.error("%s", error)
            if error.kind is Kind.WORK:
                self.send_outcomes([Outcome.failed(item, f"malformed work: {error}", 0.0)
                                    for item in error.message.items])
            return None
        except ProtocolError as error:
            log.error("dropped a malformed message from the scheduler: %s", error)
            return None

    def send_outcomes(self, outcomes) -> None:
        """Each finished item's images to the frontend, then every item's result to the
        scheduler (which answers the request once all of its images are made)."""
        if not outcomes:
            return
        for o in outcomes:
            if o.code == NON_FINITE:
                self.metrics.non_finite_outputs_total.labels(executor=self.label).inc()
            if o.tensors is not None:
                self._send_tensors(o)
            elif o.images is not None:
                r = o.item.request
                # Rows of a contiguous array: sent without a copy. A video's sound track
                # follows its frames.
                buffers, channels = list(o.images), 0
                if o.audio is not None:
                    import numpy as np

                    channels = o.audio.shape[1]
                    tracks = [np.ascontiguousarray(a, dtype=np.float32) for a in o.audio]
                    buffers = [b for pair in zip(buffers, tracks) for b in pair]
                self.pixels.send_multipart(encode(Kind.IMAGES, ItemImages(
                    r.request_id, o.item.start, o.item.stop, r.width, r.height, r.num_frames,
                    channels, o.sample_rate if channels else 0), buffers), copy=False)
                self.metrics.images_generated_total.labels(executor=self.label).inc(len(o.images))
        self.sock.send_multipart(encode(Kind.ITEMS_DONE, ItemsDone([o.result() for o in outcomes])))

    def _send_tensors(self, o) -> None:
        import numpy as np

        arrays = {name: np.ascontiguousarray(value) for name, value in o.tensors.items()}
        specs = [TensorSpec(name, a.dtype.name, list(a.shape)) for name, a in arrays.items()]
        r = o.item.request
        self.pixels.send_multipart(encode(Kind.TENSORS, ItemTensors(
            r.request_id, o.item.start, o.item.stop, specs), list(arrays.values())), copy=False)
        self.metrics.images_generated_total.labels(executor=self.label).inc(o.item.samples)

    def send_partial(self, partial) -> None:
        image = partial.image
        self.pixels.send_multipart(encode(Kind.PARTIAL, Partial(
            partial.request_id, partial.index, partial.partial_index, image.shape[1],
            image.shape[0]), [image]), copy=False)
        self.metrics.partial_images_total.labels(executor=self.label).inc()

    def send_progress(self, request_id: str, done: int, total: int) -> None:
        now = time.monotonic()
        last = self._progress_sent.get(request_id)
        if done < total and last is not None and now - last < PROGRESS_INTERVAL_S:
            return
        if done >= total:
            self._progress_sent.pop(request_id, None)
        else:
            if len(self._progress_sent) > 4096:  # ids of requests that left before their end
                self._progress_sent = {k: t for k, t in self._progress_sent.items() if now - t < 600}
            self._progress_sent[request_id] = now
        self.pixels.send_multipart(encode(Kind.PROGRESS, Progress(request_id, done, total)))

    def answer_adapter(self, command_id: str, status: int = 200, error: str = "") -> None:
        self.sock.send_multipart(encode(Kind.ADAPTER_DONE, AdapterResult(command_id, status, error)))

    def answer_weights(self, result) -> None:
        self.sock.send_multipart(encode(Kind.WEIGHTS_DONE, result))

    # What the loops count.

    def count_adapter_event(self, event: str, name: str = "", seconds: float | None = None) -> None:
        m, label = self.metrics, self.label
        {"load": m.lora_loads_total, "unload": m.lora_unloads_total,
         "evict": m.lora_evictions_total}[event].labels(executor=label).inc()
        if seconds is not None:
            m.lora_load_seconds.labels(executor=label).observe(seconds)

    def _size_label(self, size: str) -> str:
        """A step's size ("WxH", or "mixed"), bounded in number: sizes are the clients'
        choice."""
        if size not in self._sizes and len(self._sizes) >= metrics.SIZE_LABELS:
            return "other"
        self._sizes.add(size)
        return size

    def count_resident(self, adapters) -> None:
        if adapters is not None:
            self.metrics.loras_resident.labels(executor=self.label).set(adapters.resident)

    def count_call(self, seconds: float, interrupted: bool) -> None:
        m, label = self.metrics, self.label
        m.batch_execution_seconds.labels(executor=label).observe(seconds)
        m.executor_busy_seconds.labels(executor=label).inc(seconds)
        if interrupted:
            m.batches_interrupted_total.labels(executor=label).inc()
        self._count_compiles()
        self._count_flops(seconds)

    def set_memory(self, info) -> None:
        """The budget and what a unit of cost takes (ModelInfo), for :meth:`count_memory`."""
        self._memory = info if info.memory_budget_bytes else None
        if self._memory is not None:
            self.metrics.memory_budget_bytes.labels(executor=self.label).set(info.memory_budget_bytes)
            self.count_memory(0.0)

    def count_memory(self, running_cost: float) -> None:
        memory = getattr(self, "_memory", None)
        if memory is not None:
            self.metrics.memory_admitted_bytes.labels(executor=self.label).set(
                memory.memory_held_bytes + running_cost * memory.memory_per_cost_bytes)

    def count_admission(self, seconds: float, admitted: int) -> None:
        self.metrics.executor_busy_seconds.labels(executor=self.label).inc(seconds)
        self.metrics.step_admissions_total.labels(executor=self.label).inc(admitted)

    def count_step(self, out) -> None:
        m, label = self.metrics, self.label
        for timed in out.timed:  # a step late on CUDA: the time of the step before
            if timed.samples:
                m.step_seconds.labels(executor=label).observe(timed.seconds)
                m.step_host_seconds.labels(executor=label).observe(timed.host_seconds)
        if out.samples:
            m.step_running_images.labels(executor=label).observe(out.samples)
            m.forward_cost.labels(executor=label).observe(out.cost)
            m.steps_total.labels(executor=label, size=self._size_label(out.size)).inc()
            m.forward_tokens.labels(executor=label).observe(out.tokens)
            m.forward_padding.labels(executor=label).observe(
                out.padding / (out.tokens + out.padding) if out.tokens else 0.0)
        m.running_sets.labels(executor=label).set(out.sets)
        self.count_memory(out.running_cost)
        m.executor_busy_seconds.labels(executor=label).inc(out.seconds)
        for o in out.finished:
            m.step_retirements_total.labels(executor=label, outcome=o.status).inc()
        for stage, seconds in out.stage_stall.items():
            m.step_stall_seconds.labels(executor=label, stage=stage).inc(seconds)
            m.stage_busy_seconds.labels(executor=label, stage=stage).inc(out.stage_busy[stage])
            m.stage_queue_depth.labels(executor=label, stage=stage).set(out.stage_depth[stage])
        if out.prompt_cache is not None:
            hits, misses = out.prompt_cache
            m.prompt_cache_requests_total.labels(executor=label, outcome="hit").inc(hits)
            m.prompt_cache_requests_total.labels(executor=label, outcome="miss").inc(misses)
        if out.cache_bytes is not None:  # the server runs a step cache
            m.step_cache_rows_total.labels(executor=label, outcome="hit").inc(out.cache_hits)
            m.step_cache_rows_total.labels(executor=label, outcome="miss").inc(out.cache_misses)
            m.step_cache_bytes.labels(executor=label).set(out.cache_bytes)
        self._count_compiles()
        self._count_flops(out.seconds)

    def watch_compiles(self, compiled) -> None:
        """Count ``compiled``'s graphs: those built so far as start-up's, later ones (a size or
        bucket first seen while serving) as they come."""
        self._compiled = compiled
        if compiled is not None:
            self.metrics.compiles_total.labels(executor=self.label, when="startup").inc(
                compiled.take_new())

    def watch_flops(self, counter, peak: float) -> None:
        """Count ``counter``'s model FLOPs; with the device's ``peak`` FLOP/s, the utilisation."""
        from diffserve.executor.accel.flops import Utilization

        self._flops = counter
        self._utilization = Utilization(peak) if counter is not None and peak else None

    def _count_flops(self, seconds: float) -> None:
        """The FLOPs since the last count, and the utilisation (step times come a step late on
        CUDA; over the utilisation's window the two line up)."""
        if self._flops is None:
            return
        flops = self._flops.take()
        self.metrics.model_flops_total.labels(executor=self.label).inc(flops * self._flops.scale)
        if self._utilization is not None:
            value = self._utilization.add(flops, seconds)
            if value is not None:
                self.metrics.model_flops_utilization.labels(executor=self.label).set(value)

    def _count_compiles(self) -> None:
        new = self._compiled.take_new() if self._compiled is not None else 0
        if new:
            log.info("--compile: %d graphs compiled while serving (a size or batch bucket seen "
                     "for the first time)", new)
            self.metrics.compiles_total.labels(executor=self.label, when="serving").inc(new)
