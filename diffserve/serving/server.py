"""``diffserve serve``: the frontend process, which starts the engine (the scheduler, which
starts the executors), waits for the model, then serves HTTP until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from diffserve import processes
from diffserve.config.flags import ServerConfig

log = logging.getLogger("diffserve")


def serve(config: ServerConfig) -> int:
    """Run the server; returns the process exit code."""
    try:
        import setproctitle

        setproctitle.setproctitle("diffserve::frontend")
    except ImportError:  # pragma: no cover
        pass
    processes.configure_logging(config.log_level, "diffserve::frontend")
    try:
        return _serve(config)
    finally:
        processes.stop_resource_tracker()


def _serve(config: ServerConfig) -> int:
    from diffserve.frontend.scheduler_client import StartupError
    from diffserve.serving.backend import Backend
    from diffserve.serving.models import ModelSet

    # First: the model loads in its own process while this one imports (several: side by side).
    host = (ModelSet(config) if len(config.served_models) > 1
            else Backend(config.for_model(config.model_name)))
    scheduler = host.client
    exit_code = 0
    try:
        import uvicorn

        from diffserve.frontend.app import create_app

        _Server = _uvicorn_server_class()
        try:
            info = host.wait_ready()
        except StartupError as error:
            log.error("cannot start: %s", error)
            return 1
        server: uvicorn.Server | None = None

        def engine_failed(reason: str) -> None:
            """The server cannot answer any more: exit non-zero, for the supervisor (systemd,
            Kubernetes) to start it again. Every waiting request has been answered 503."""
            nonlocal exit_code
            log.error("%s; every waiting request was answered 503; exiting", reason)
            exit_code = 1
            if server is not None:
                server.should_exit = True

        app = create_app(config, scheduler, host.metrics, host.render_metrics)
        app.router.lifespan_context = lambda app: host.serving(engine_failed)
        server = _Server(uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.log_level,
            # A little longer than our own drain, so the 503s it ends with are still written.
            timeout_graceful_shutdown=config.shutdown_timeout_s + 5,
            access_log=config.log_level == "debug"))
        server.scheduler, server.drain_s = scheduler, config.shutdown_timeout_s
        names = ", ".join(repr(name) for name, *_ in scheduler.model_states())
        server.ready_message = (
            f"diffserve ready: serving {names} on http://{config.host}:{config.port} "
            f"({info.batching_mode} batching, max batch {config.dynamic_batch_max_size}, delay "
            f"{config.dynamic_batch_delay_ms:g} ms)")
        server.run()
        if not server.started:
            exit_code = exit_code or 1
        return exit_code
    finally:
        host.stop()


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, with our own stop: SIGINT/SIGTERM refuse new work (503) at once, let
        accepted requests finish for ``drain_s``, answer what is left 503, and exit 0. (uvicorn's
        own handler re-raises the signal after stopping, which would make a clean stop a crash.)"""

        scheduler = None
        drain_s = 30.0
        ready_message = ""

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:  # listening: the one line that tells a user (or a test) it is ready
                log.info("%s", self.ready_message)

        @contextlib.contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._stop_gracefully, sig)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

        def _stop_gracefully(self, sig) -> None:
            from diffserve.errors import unavailable

            if self.should_exit:  # a second signal: stop now
                self.force_exit = True
                return
            log.info("received %s: finishing accepted requests (up to %g s), refusing new ones",
                     signal.Signals(sig).name, self.drain_s)
            self.scheduler.draining = True  # refuse new work from now on
            asyncio.ensure_future(self.scheduler.drain())
            self.should_exit = True
            asyncio.get_running_loop().call_later(self.drain_s, self.scheduler.fail_all, unavailable(
                "The server is shutting down and could not finish this request in time "
                "(--shutdown-timeout-s)."))

    return Server
