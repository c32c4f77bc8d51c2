"""The HTTP application: every route, and the one place where errors become HTTP.

The routes live by what they do: making images (:mod:`~diffserve.frontend.image_routes`, whose
requests go through :class:`~diffserve.frontend.serving.Serving`), runtime LoRA updates
(:mod:`~diffserve.frontend.adapter_routes`), weight updates and sleeping
(:mod:`~diffserve.frontend.weight_routes`) and what the server says of itself
(:mod:`~diffserve.frontend.info_routes`). Every error leaves through
:func:`diffserve.errors.error_response`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffserve import __version__
from diffserve.config.flags import ServerConfig
from diffserve.errors import APIError, error_response, internal_error, method_not_allowed, not_found
from diffserve.frontend.adapter_routes import adapter_routes
from diffserve.frontend.auth import BearerAuth
from diffserve.frontend.bodies import validation_error
from diffserve.frontend.scheduler_client import SchedulerClient
from diffserve.frontend.image_routes import image_routes
from diffserve.frontend.image_store import ImageStore
from diffserve.frontend.image_content import image_content_routes
from diffserve.frontend.image_jobs.jobs import ImageJobs
from diffserve.frontend.image_jobs.routes import ResumeOnStart, job_routes
from diffserve.frontend.image_jobs.store import ImageJobStore
from diffserve.frontend.image_jobs.webhooks import Webhooks
from diffserve.frontend.info_routes import info_routes
from diffserve.frontend.serving import Serving
from diffserve.frontend.weight_routes import weight_routes
from diffserve.metrics import FrontendMetrics


def create_app(config: ServerConfig, scheduler: SchedulerClient, counts: FrontendMetrics,
               render_metrics: Callable[[], tuple[bytes, str]], video_peers=None) -> FastAPI:
    """``counts``: where the frontend counts requests; ``render_metrics``: the /metrics body;
    ``video_peers``: a Ray Serve replica's view of the others, where their video jobs live."""
    app = FastAPI(title="diffserve", version=__version__,
                  description="OpenAI-style image generation and editing with dynamic batching.")
    if config.api_key:
        app.add_middleware(BearerAuth, keys=config.api_keys)
    add_error_handlers(app)
    images = ImageStore(config.image_dir, config.image_ttl_s, config.max_image_store_bytes)
    serving = Serving(config, scheduler, counts,
                      ThreadPoolExecutor(max_workers=2, thread_name_prefix="encode"), images)
    jobs = ImageJobs(ImageJobStore(images.local_dir), serving, Webhooks(config.webhook_secret),
                     config.image_ttl_s)
    router, rebuild = image_routes(serving, jobs)
    app.include_router(router)
    app.include_router(image_content_routes(serving))
    app.include_router(job_routes(jobs))
    app.add_middleware(ResumeOnStart, jobs=jobs, rebuild=rebuild)
    app.state.image_jobs = jobs
    if getattr(getattr(scheduler, "model_info", None), "num_frames", 0):  # a video model
        from diffserve.frontend.videos.setup import video_api

        router, app.state.video_jobs = video_api(serving, counts, video_peers)
        app.include_router(router)
    if config.enable_lora_runtime_updates:
        app.include_router(adapter_routes(serving))
    if config.enable_weight_updates:
        app.include_router(weight_routes(serving))
    app.include_router(info_routes(scheduler, render_metrics))
    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error_response(not_found(request.url.path))
        if exc.status_code == 405:
            return error_response(method_not_allowed(request.method, request.url.path))
        return error_response(APIError(str(exc.detail), status=exc.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(internal_error())
