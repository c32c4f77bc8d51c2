"""Serving past one node on Ray Serve: every replica hosts what one ``diffserve serve`` hosts (a
model's engine: a scheduler and its executors; several models: an engine each, routed and
swapped as one server does) behind Ray Serve's HTTP proxy, with the same routes, errors and
streaming.

    pip install '.[ray]'
    serve run diffserve.ray:app model=shapes num_replicas=2
    serve run diffserve.ray:app model=sd=tiny-sd,xl=tiny-sdxl resident_models=1

Arguments are ``diffserve serve``'s flags without the dashes (``dynamic_batch_max_size=8`` or
``dynamic-batch-max-size=8``), plus the deployment's own:

- ``num_replicas``: a number, or ``auto`` to scale on ongoing requests (default 1);
- ``min_replicas`` / ``max_replicas``: autoscaling bounds (given either, it autoscales);
- ``target_ongoing_requests``: requests per replica the autoscaler aims at (default: twice the
  images an engine batches at once, so a replica is scaled out before its queue builds up);
- ``max_ongoing_requests``: the most a replica is sent at once (default 4x the target);
- ``num_cpus`` / ``num_gpus``: what Ray reserves for each replica (default 1 / 0; on GPU nodes
  give ``num_gpus`` the replica's devices, e.g. ``num_gpus=2 data_parallel_size=2``).

``model`` takes what ``--model`` takes, several models comma-separated (``model=a=X,b=Y``) or,
in a Serve config file, as a list.
"""

from __future__ import annotations

import dataclasses
from contextlib import asynccontextmanager
from typing import Any

from diffserve.config.flags import ConfigError, ServerConfig, parse_value

# Deployment options, with their types; everything else is a ServerConfig field.
_DEPLOYMENT_ARGS = {"num_replicas": str, "min_replicas": int, "max_replicas": int,
                    "target_ongoing_requests": float, "max_ongoing_requests": int,
                    "num_cpus": float, "num_gpus": float}


def parse_args(args: dict[str, Any]) -> tuple[ServerConfig, dict[str, Any]]:
    """(the engine's config, the deployment's options) from ``serve run``'s key=value pairs."""
    fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    values, deployment = {}, {}
    for key, value in args.items():
        name = key.replace("-", "_")
        if name in _DEPLOYMENT_ARGS:
            deployment[name] = _DEPLOYMENT_ARGS[name](value)
        elif name in fields and fields[name].metadata.get("repeat") and isinstance(value, list):
            values[name] = [str(v) for v in value]  # a Serve config's list: --model given twice
        elif name in fields:
            values[name] = parse_value(fields[name], str(value)) if isinstance(value, str) else value
        else:
            raise ConfigError(f"unknown argument {key!r}: use diffserve serve's flags or "
                              f"{', '.join(_DEPLOYMENT_ARGS)}")
    config = ServerConfig.from_mapping(values)
    return config, deployment_options(config, deployment)


def deployment_options(config: ServerConfig, given: dict[str, Any]) -> dict[str, Any]:
    target = given.get("target_ongoing_requests") or 2 * config.dynamic_batch_max_size * config.num_executors
    options: dict[str, Any] = {
        "max_ongoing_requests": given.get("max_ongoing_requests") or int(4 * target),
        "ray_actor_options": {"num_cpus": given.get("num_cpus", 1.0),
                              "num_gpus": given.get("num_gpus", 0.0)},
        # Long enough for the engine to finish what it accepted (and to load on start).
        "graceful_shutdown_timeout_s": config.shutdown_timeout_s + 5,
        "health_check_timeout_s": 30,
    }
    replicas = given.get("num_replicas", "1")
    if replicas == "auto" or "min_replicas" in given or "max_replicas" in given:
        options["autoscaling_config"] = {
            "min_replicas": given.get("min_replicas", 1),
            "max_replicas": given.get("max_replicas", max(given.get("min_replicas", 1), 4)),
            "target_ongoing_requests": target,
        }
    else:
        options["num_replicas"] = int(replicas)
    return options


def start_engine(config: ServerConfig):
    """A replica's engines, started as ``diffserve serve`` starts them (its models load in the
    engines' own processes): one model's :class:`~diffserve.serving.backend.Backend`, or several
    models' :class:`~diffserve.serving.models.ModelSet`."""
    from diffserve.serving.backend import Backend
    from diffserve.serving.models import ModelSet

    rank = _rank()
    if config.video_dir:
        config = dataclasses.replace(config, video_dir=f"{config.video_dir}/replica-{rank}")
    if len(config.served_models) > 1:
        return ModelSet(config)
    return Backend(config.for_model(config.model_name))


def _rank() -> int:
    from ray import serve

    return serve.get_replica_context().rank.rank


def replica_app(host):
    """The ASGI app of one replica over its engine ``host`` (several models: their set), which
    has loaded its model (several: the first ones; the others load as the app starts). A video
    model's replica keeps its jobs in a store of its own (``--video-dir``/replica-<rank>) and
    reaches the other replicas' jobs through them (:mod:`diffserve.frontend.videos.peers`)."""
    import logging

    from diffserve.frontend.app import create_app

    config = host.config

    def engine_failed(reason: str) -> None:
        # Every waiting request has its 503; the health check fails from now on, and Ray Serve
        # replaces the replica.
        logging.getLogger("diffserve").error("%s; this replica is being replaced", reason)

    peers = None
    if host.client.model_info.num_frames:
        from diffserve.frontend.videos.peers import Peers

        rank = _rank()
        directory = _video_directory()
        peers = Peers(rank, lambda r: directory.address.remote(r), directory.addresses.remote)

    @asynccontextmanager
    async def lifespan(app):
        try:
            async with host.serving(engine_failed):
                if peers is None:
                    yield
                    return
                async with _internal_listener(app) as address:
                    await directory.register.remote(rank, address)
                    yield
                await peers.close()
        finally:
            host.stop()

    app = create_app(config, host.client, host.metrics, host.render_metrics, peers)
    app.router.lifespan_context = lifespan
    app.state.engine_host = host
    return app


class VideoDirectory:
    """Every replica's internal address by rank (a detached, named actor of the application)."""

    def __init__(self) -> None:
        self._addresses: dict[int, str] = {}

    def register(self, rank: int, address: str) -> None:
        self._addresses[rank] = address

    def address(self, rank: int) -> str | None:
        return self._addresses.get(rank)

    def addresses(self) -> dict[int, str]:
        return dict(self._addresses)


def _video_directory():
    """The application's directory of replica addresses, made by the first replica to ask. A
    replica's rank passes to the replica that replaces it, and so does its entry."""
    import ray
    from ray import serve

    app_name = serve.get_replica_context().replica_id.deployment_id.app_name
    return ray.remote(num_cpus=0)(VideoDirectory).options(
        name=f"diffserve-videos-{app_name}", lifetime="detached", get_if_exists=True).remote()


@asynccontextmanager
async def _internal_listener(app):
    """The replica's own HTTP address on its node (Ray Serve's proxy fronts every replica as
    one), where the other replicas pass on requests about the video jobs it holds."""
    import asyncio
    import contextlib

    import ray
    import uvicorn

    class Listener(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # the replica's process keeps its own signal handling
            yield

    host = ray.util.get_node_ip_address()
    server = Listener(uvicorn.Config(app, host=host, port=0, lifespan="off", log_level="warning"))
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises why it could not listen
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await task


# The replica's engine, between its deployment's constructor and the app builder Ray calls
# after it (a Ray Serve replica is a process of its own, one engine each).
_loaded: list = []


def app(args: dict[str, Any]):
    """The Ray Serve application builder (``serve run diffserve.ray:app key=value ...``)."""
    import asyncio

    from ray import serve

    from diffserve.frontend.scheduler_client import StartupError

    config, options = parse_args(args)

    def build():  # on each replica, after its constructor (Ray requires a plain function)
        return replica_app(_loaded.pop())

    @serve.deployment(name="diffserve", **options)
    @serve.ingress(build)
    class Diffserve:
        """One diffserve server's engines behind Ray Serve's HTTP proxy."""

        async def __init__(self) -> None:
            # The model loads in the engine's processes; the wait for it runs off the replica's
            # event loop, so that a stop asked for meanwhile (serve run's Ctrl-C, a scale-down)
            # is heard at once (__del__), not once the model has loaded or Ray's grace period
            # (--shutdown-timeout-s + 5 s) is over.
            self.host, self.loading, self.stopped = start_engine(config), True, False
            try:
                await asyncio.to_thread(self.host.wait_ready)
            except StartupError:  # the scheduler has exited or is exiting: this is quick
                self.host.stop()
                if self.stopped:
                    raise StartupError("the replica was stopped while its model loaded") from None
                raise
            self.loading = False
            _loaded.append(self.host)

        async def __del__(self) -> None:
            if getattr(self, "loading", False):  # nothing to drain: the wait above ends at once
                self.stopped = True
                self.host.kill()  # every engine's scheduler (its executors die with it)
            await super().__del__()  # the app's lifespan: the engine drains, then stops

        def check_health(self) -> None:
            # Every model's engine: one that died fails the replica, as it stops diffserve serve.
            problem = self.app.state.engine_host.health_problem()
            if problem:
                raise RuntimeError(problem)

    return Diffserve.bind()
