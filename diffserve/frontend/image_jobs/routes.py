"""The HTTP side of image jobs: ``Prefer: respond-async`` on generations and edits answers 202
with the job and its ``Location``; ``GET /v1/images/jobs/{id}`` gives its status and, once
completed, its answer; ``DELETE`` cancels it. Jobs left unfinished by the last server are resumed
when this one starts serving (:class:`ResumeOnStart`)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from diffserve.errors import APIError, invalid_request
from diffserve.frontend.image_jobs.jobs import ImageJobs
from diffserve.frontend.image_jobs.webhooks import check_webhook
from diffserve.frontend.serving import Accepted

log = logging.getLogger(__name__)


def prefers_async(http_request: Request) -> bool:
    """``Prefer: respond-async`` (RFC 7240), among other preferences or alone."""
    prefer = http_request.headers.get("prefer", "")
    return any(part.split(";")[0].strip().lower() == "respond-async"
               for part in prefer.split(","))


def check_job_fields(body, asynchronous: bool, config) -> None:
    """The webhook fields belong to jobs; a job's webhook must be one the server posts to."""
    if not asynchronous:
        if body.webhook is not None or body.webhook_events_filter is not None:
            raise invalid_request("webhook is for asynchronous jobs: send the request with "
                                  "'Prefer: respond-async'", "webhook", "invalid_value")
        return
    if body.stream:
        raise invalid_request("an asynchronous job is not streamed (its previews go to its "
                              "webhook as output events)", "stream", "unsupported_value")
    check_webhook(body.webhook, body.webhook_events_filter, config.webhook_secret,
                  config.allowed_webhook_hosts)


def job_not_found(job_id: str) -> APIError:
    return APIError(f"No image job {job_id!r}: it never existed or has expired "
                    "(--image-ttl-s).", "job_id", "job_not_found", 404)


def accepted_response(jobs: ImageJobs, http_request: Request, route: str, stored: dict,
                      key_priority, accepted: Accepted, events: str) -> JSONResponse:
    job = jobs.create(route, stored, key_priority, accepted, events, str(http_request.base_url))
    location = f"/v1/images/jobs/{job.id}"
    return JSONResponse(job.view(), status_code=202, headers={"Location": location})


def job_routes(jobs: ImageJobs) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/images/jobs/{job_id}")
    async def get_job(job_id: str):
        job = jobs.get(job_id)
        if job is None:
            raise job_not_found(job_id)
        return JSONResponse(job.view())

    @router.delete("/v1/images/jobs/{job_id}")
    async def cancel_job(job_id: str):
        job = await jobs.cancel(job_id)
        if job is None:
            raise job_not_found(job_id)
        return JSONResponse(job.view())

    return router


class ResumeOnStart:
    """ASGI middleware: at the application's start (its lifespan), the jobs left unfinished are
    resumed in the background, once the engine serves."""

    def __init__(self, app, jobs: ImageJobs, rebuild) -> None:
        self.app, self.jobs, self.rebuild = app, jobs, rebuild
        self.task: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan" and self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.jobs.resume(self.rebuild))
            self.task.add_done_callback(
                lambda t: t.cancelled() or t.exception() is None
                or log.error("resuming image jobs failed: %r", t.exception()))
        await self.app(scope, receive, send)
