"""Several models behind one frontend (``--model NAME=PATH`` repeated): one engine per model
(:class:`~diffserve.serving.backend.Backend`: its scheduler and executors, as a one-model server
runs them), routed by the request's ``model``, with the face of the one engine's client that the
routes talk to. Which models stay awake is :mod:`diffserve.serving.residency`'s business.

Each model's engine is built from :meth:`ServerConfig.for_model` (docs/models.md#several-models):
its own diffserve.json defaults, start-up checks and batching mode; adapters and control models
only on the default model. A model that cannot load is listed as failed and answers 503; the
server starts while any model loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from diffserve import metrics
from diffserve.config.flags import ServerConfig
from diffserve.config.models import swaps
from diffserve.errors import APIError, model_not_found, unavailable
from diffserve.frontend.client_events import DoneEvent, StartupError, final_event
from diffserve.policies.swaps import SwapPolicy
from diffserve.serving.backend import Backend
from diffserve.serving.residency import (
    DEVICE,
    FAILED,
    ModelMetrics,
    ModelRecord,
    Residency,
    weight_bytes,
)

log = logging.getLogger("diffserve")


class ModelSet:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = metrics.FrontendMetrics()
        self.metrics_dir = metrics.prepare_directory()
        self.names = list(config.served_models)
        self.records = {name: ModelRecord() for name in self.names}
        self.model_metrics = ModelMetrics(self.metrics.registry, self.names)
        self.limit = config.resident_models if swaps(config) else 0
        self.policy = SwapPolicy(self.names, self.limit, config.resident_model_bytes,
                                 config.max_swap_wait_ms / 1000,
                                 host_budget_bytes=config.resident_host_bytes,
                                 host_copies=config.num_executors * config.degrees.size)
        self.engines: dict[str, Backend] = {}  # those that loaded
        self.residency = Residency({}, self.policy, self.records, self.model_metrics)
        self.default = self.names[0]
        self.client = self  # what the routes talk to
        self.shared_dir = None  # no weight updates with several models
        # As many models as may be awake load side by side; each of the others loads once one
        # of them sleeps (:meth:`serving`), so that a device never holds more than it may.
        self._all: dict[str, Backend] = {}  # the engines started
        self._later = list(self.names)  # the models not started yet
        self._killed = False
        self._start(self.limit or len(self.names))

    def _start(self, count: int) -> list[str]:
        if self._killed:
            return []
        names, self._later = self._later[:count], self._later[count:]
        for name in names:
            self._all[name] = Backend(self.config.for_model(name), self.metrics_dir, self.metrics)
        return names

    # -- start and stop --------------------------------------------------------------------

    def wait_ready(self):
        """Wait for the models started (where one fails, the next starts in its place); the
        default model's info. Raises StartupError if none loads."""
        started = list(self._all)
        while started:
            name = started.pop(0)
            if not self._settle(name, self._all[name].wait_ready):
                started += self._start(1)
        if not self.engines:
            raise StartupError("no model could load: " + "; ".join(
                f"{name}: {r.error}" for name, r in self.records.items()))
        self.default = next(iter(self.engines))
        return self.model_info

    def _settle(self, name: str, wait) -> bool:
        """Wait for ``name``'s engine (``wait``: its wait_ready); whether it loaded."""
        backend = self._all[name]
        try:
            info = wait()
        except StartupError as error:
            log.error("model %r could not load: %s", name, error)
            record = self.records[name]
            record.location, record.error = FAILED, str(error)
            self.policy.failed(name, str(error))
            backend.stop()
            return False
        self.engines[name] = backend
        record = self.records[name]
        record.size_bytes, record.loaded_at = weight_bytes(info), time.time()
        self.policy.loaded(name, record.size_bytes, time.monotonic())
        self.residency.add(name, backend.client)
        return True

    async def _load_later(self, name: str) -> bool:
        """Past the bound: the awake model loaded last sleeps, then ``name`` loads (where it
        cannot, the other wakes again)."""
        awake = [n for n in self.engines if self.records[n].location == DEVICE]
        slept = None
        if self.limit and len(awake) >= self.limit and await self.residency.swap(awake[-1], None):
            slept = awake[-1]
        self._start(1)
        loaded = await asyncio.to_thread(self._settle, name, self._all[name].wait_ready)
        if not loaded and slept is not None:
            await self.residency.swap(None, slept)
        return loaded

    @contextlib.asynccontextmanager
    async def serving(self, on_failure):
        """While the app serves (the server listens once every model has loaded)."""
        async with contextlib.AsyncExitStack() as stack:
            for backend in self.engines.values():
                await stack.enter_async_context(backend.serving(on_failure))
            for name in list(self._later):
                if await self._load_later(name):
                    await stack.enter_async_context(self.engines[name].serving(on_failure))
            task = asyncio.get_running_loop().create_task(self.residency.run())
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def health_problem(self) -> str | None:
        """Why some loaded model's engine can no longer serve, or None (a Ray Serve replica's
        health: one that died fails the replica, as it stops ``diffserve serve``)."""
        for name, backend in list(self.engines.items()):
            problem = backend.health_problem()
            if problem:
                return f"model {name!r}: {problem}"
        return None

    def kill(self) -> None:
        """Kill every engine started, and start no other (a stop while the models load)."""
        self._killed = True
        for backend in list(self._all.values()):
            backend.kill()

    def stop(self) -> None:
        for name, backend in self._all.items():
            if self.records[name].location != FAILED:  # (those were stopped as they failed)
                backend.stop()
        metrics.remove_directory(self.metrics_dir)

    def render_metrics(self) -> tuple[bytes, str]:
        self.residency.update_gauges()
        return metrics.render(self.metrics_dir, self.metrics)

    # -- the face of one engine's client ---------------------------------------------------

    @property
    def _default(self):
        return self.engines[self.default].client

    @property
    def model_info(self):
        return self._default.model_info

    @property
    def adapters(self) -> dict[str, None]:
        return self._default.adapters

    @property
    def status(self):
        return self._default.status

    @property
    def ready(self) -> bool:
        return any(b.client.ready for b in self.engines.values())

    @property
    def draining(self) -> bool:
        return self._default.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        for backend in self.engines.values():
            backend.client.draining = value

    @property
    def stopped_reason(self) -> str | None:
        reasons = [b.client.stopped_reason for b in self.engines.values()]
        return reasons[0] if all(reasons) else None

    @property
    def in_flight(self) -> int:
        return sum(b.client.in_flight for b in self.engines.values())

    def route(self, name: str | None):
        """The info and adapters of the model ``name`` picks: a served model, else the default
        model (whose adapters a name may pick); a failed or restarting model is a 503, any
        other name a 404 naming the served models."""
        if name is None or name not in self.records:
            if name is None or name in self.adapters:
                return self._default.route(name)
            raise model_not_found(name, self.names, self.adapters)
        record = self.records[name]
        if record.location == FAILED:
            raise unavailable(f"The model {name!r} could not load: {record.error}",
                              "model_unavailable")
        if name not in self.engines:
            raise unavailable(f"The model {name!r} has not loaded yet.", "engine_not_ready")
        client = self.engines[name].client
        if not client.ready:
            raise unavailable(f"The model {name!r} is not ready (its executor is starting or "
                              "restarting); retry shortly.", "engine_not_ready")
        return client.route(name)

    @property
    def engines_by_name(self):
        return {name: b.client for name, b in self.engines.items()}

    def model_states(self):
        states = []
        for name in self.names:
            record = self.records[name]
            more = {k: v for k, v in vars(record).items() if v is not None}
            info = self.engines[name].client.model_info if name in self.engines else None
            states.append((name, info, more))
        return states

    async def submit(self, request, frames=()):
        self.route(request.model)  # a model that failed or went away since it was checked
        submission = await self.engines[request.model].client.submit(request, frames)
        self.residency.arrived()
        return submission

    async def generate(self, request, frames=()) -> DoneEvent:
        return await final_event(await self.submit(request, frames))

    async def adapter_command(self, *args, **kwargs):
        return await self._default.adapter_command(*args, **kwargs)

    async def weights_command(self, command):
        raise APIError("weight commands are not served with several models", None,
                       "unsupported", 400, "invalid_request_error")

    def fail_all(self, error: APIError) -> None:
        for backend in self.engines.values():
            backend.client.fail_all(error)

    async def drain(self) -> None:
        for backend in self.engines.values():
            await backend.client.drain()
