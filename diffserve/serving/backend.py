"""The engine as a frontend hosts it: the scheduler process (which starts the executors), the
client that talks to it, and the directories they share. ``diffserve serve`` hosts one in its
own process; a Ray Serve replica (:mod:`diffserve.ray`) hosts one per replica."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from contextlib import asynccontextmanager
from typing import Callable

from diffserve import metrics, processes
from diffserve.wire import shared_tensors
from diffserve.config.flags import ServerConfig
from diffserve.errors import unavailable

log = logging.getLogger("diffserve")


class Backend:
    def __init__(self, config: ServerConfig, metrics_dir: str | None = None,
                 counts: metrics.FrontendMetrics | None = None) -> None:
        """``metrics_dir``, ``counts``: shared with other engines of the same frontend (several
        models); it then leaves the directory to its owner."""
        import zmq

        from diffserve.frontend.scheduler_client import SchedulerClient
        from diffserve.scheduler.service import SchedulerSpec, run_scheduler

        self.config = config
        self.metrics = counts or metrics.FrontendMetrics()  # what the frontend hosting it counts
        self.owns_metrics_dir = metrics_dir is None
        self.metrics_dir = metrics_dir or metrics.prepare_directory()
        self._models = None  # the per-model figures, made once the model's name is known
        self.ipc_dir = tempfile.mkdtemp(prefix="diffserve-")
        self._ctx = zmq.Context()
        self.client = SchedulerClient(self._ctx, self.ipc_dir)
        # Where weight updates handed over in shared memory are kept (diffserve.wire.shared_tensors).
        self.shared_dir = self.client.shared_dir = (
            shared_tensors.shared_directory() if config.enable_weight_updates else None)
        spec = SchedulerSpec(config, self.client.request_addr, self.client.result_addr,
                             self.ipc_dir, self.metrics_dir, os.getpid())
        self.scheduler = processes.start(run_scheduler, spec, "diffserve::scheduler")

    def wait_ready(self):
        """Block until an executor has loaded the model; its ModelInfo. Raises StartupError."""
        log.info("loading model %r ...", self.config.model)
        info = self.client.wait_ready(self.scheduler.sentinel, self.config.startup_timeout_s)
        log.info("model %r ready (%s, %dx%d, %s/%s, %s batching, %d executor(s))", info.name,
                 info.pipeline_class, info.width, info.height, info.device, info.dtype,
                 info.batching_mode, self.config.num_executors)
        return info

    def render_metrics(self) -> tuple[bytes, str]:
        info = self.client.model_info
        if self.owns_metrics_dir and info is not None:  # one model (several: ModelSet's own)
            from diffserve.serving.residency import ModelMetrics

            if self._models is None:
                self._models = ModelMetrics(self.metrics.registry, [info.name])
            self._models.one_model(info, self.client.in_flight)
        return metrics.render(self.metrics_dir, self.metrics)

    @asynccontextmanager
    async def serving(self, on_failure: Callable[[str], None]):
        """While an app serves: the client reads the engine's messages. ``on_failure(reason)`` is
        called once if the engine can no longer serve (the scheduler process died, or the
        client's reader failed); every waiting request has been answered 503 by then."""
        loop = asyncio.get_running_loop()
        sentinel = self.scheduler.sentinel

        def died() -> None:
            loop.remove_reader(sentinel)
            self.client.fail_all(unavailable("The scheduler process died; the server is stopping."))
            on_failure("the scheduler process died")

        await self.client.start(on_failure)
        loop.add_reader(sentinel, died)
        try:
            yield
        finally:
            loop.remove_reader(sentinel)
            await self.client.close()

    def health_problem(self) -> str | None:
        """Why the engine can no longer serve (its scheduler died or stopped), or None."""
        if not self.scheduler.is_alive() or self.client.stopped_reason:
            return self.client.stopped_reason or "the scheduler process died"
        return None

    def kill(self) -> None:
        """Kill the scheduler at once (its executors die with it): a stop while it loads."""
        self.scheduler.kill()

    def stop(self) -> None:
        """Ask the scheduler to stop (it answers what is left and stops the executors), make
        sure it did, and remove what the engine left on disk."""
        if self.scheduler.is_alive():
            self.client.send_shutdown()
            self.scheduler.join(10)
        processes.stop(self.scheduler)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        if self.shared_dir:
            shutil.rmtree(self.shared_dir, ignore_errors=True)
        if self.owns_metrics_dir:
            metrics.remove_directory(self.metrics_dir)
