"""Image jobs in the frontend: a request accepted with ``Prefer: respond-async`` is a row in the
store from the moment it is accepted, and a task that runs it through the engine, keeps its answer
(the same JSON a plain request gets) and posts its webhook events (start, output for each partial
image, completed). Cancelling a job cancels its task, whose submission, closed, drops the work
from the engine at its next step. A server finds the jobs its predecessor left queued or running
and runs them again (:meth:`ImageJobs.resume`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Awaitable, Callable

from diffserve.errors import APIError
from diffserve.frontend.image_jobs.store import (CANCELLED, COMPLETED, FAILED, FINISHED,
                                                 IN_PROGRESS, QUEUED, ImageJob, ImageJobStore)
from diffserve.frontend.image_jobs.webhooks import EVENTS, Webhooks
from diffserve.frontend.responses import ImageAnswer
from diffserve.frontend.scheduler_client import DoneEvent, PartialEvent
from diffserve.frontend.serving import Accepted, Serving

log = logging.getLogger(__name__)

READY_POLL_S = 0.2


def new_id() -> str:
    """``imgjob_``, the creation time (fixed-width hex nanoseconds: ids sort by creation), a
    random part."""
    return f"imgjob_{time.time_ns():016x}{uuid.uuid4().hex[:12]}"


class ImageJobs:
    def __init__(self, store: ImageJobStore, serving: Serving, webhooks: Webhooks,
                 ttl_s: float) -> None:
        self.store, self.serving, self.webhooks, self.ttl_s = store, serving, webhooks, ttl_s
        self.running: dict[str, asyncio.Task] = {}

    def create(self, route: str, stored: dict, key_priority: int | None, accepted: Accepted,
               events: str, base_url: str) -> ImageJob:
        """Store an accepted request as a queued job and start it. ``stored``: its body as a
        JSON body, to run it again after a restart."""
        job = ImageJob(new_id(), route, QUEUED, int(time.time()),
                       {"request": stored, "events": events, "base_url": base_url},
                       key_priority)
        self.store.insert(job)
        self._start(job, accepted)
        return job

    def _start(self, job: ImageJob, accepted: Accepted) -> None:
        task = asyncio.get_running_loop().create_task(self._run(job, *accepted))
        self.running[job.id] = task
        task.add_done_callback(lambda _: self.running.pop(job.id, None))

    def _emit(self, job: ImageJob, body, event: str, data: dict) -> None:
        wanted = body.webhook_events_filter or EVENTS
        if body.webhook and event in wanted:
            self.webhooks.send(body.webhook, job.id, event, data)

    def _finish(self, job: ImageJob, body, **values) -> None:
        now = int(time.time())
        values.update(completed_at=now, expires_at=now + int(self.ttl_s))
        self.store.update(job.id, **values)
        self._emit(job, body, "completed", self.store.get(job.id).view())

    async def _run(self, job: ImageJob, request, frames: list, body) -> None:
        serving = self.serving
        answer = ImageAnswer(request, body, job.body["events"], job.created_at,
                             serving.scheduler.route(request.model)[0].spatial_stride, serving.pool,
                             serving.url_keeper(job.body["base_url"], body))
        if body.webhook and body.partial_images and "output" in (body.webhook_events_filter
                                                                  or EVENTS):
            request = dataclasses.replace(request, partial_images=body.partial_images)
        try:
            submission = await serving.scheduler.submit(request, frames)
            try:
                self.store.update(job.id, status=IN_PROGRESS)
                self._emit(job, body, "start", self.store.get(job.id).view())
                while not isinstance(event := await submission.next(), DoneEvent):
                    if isinstance(event, PartialEvent):
                        (b64,) = await answer._encode([event.frame])
                        self._emit(job, body, "output", {
                            "id": job.id, "b64_json": b64, "image_index": event.partial.index,
                            "partial_image_index": event.partial.partial_index})
            finally:
                submission.close()  # cancelled meanwhile: the engine drops it at its next step
            result = await answer.answer(event)
        except asyncio.CancelledError:
            raise
        except APIError as error:
            self._finish(job, body, status=FAILED, error=error.body()["error"])
        except Exception as error:  # noqa: BLE001 - this job fails, the server goes on
            log.exception("image job %s failed", job.id)
            self._finish(job, body, status=FAILED, error={
                "message": f"{type(error).__name__}: {error}", "type": "server_error",
                "param": None, "code": "internal_error"})
        else:
            self._finish(job, body, status=COMPLETED, result=result)

    def get(self, job_id: str) -> ImageJob | None:
        """The job; None if unknown, or finished longer than --image-ttl-s ago."""
        self.store.delete_expired(int(time.time()))
        return self.store.get(job_id)

    async def cancel(self, job_id: str) -> ImageJob | None:
        """Cancel a queued or running job (a finished one is left as it is)."""
        job = self.get(job_id)
        if job is None or job.status in FINISHED:
            return job
        task = self.running.get(job_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._finish(job, accepted_body_of(job), status=CANCELLED)
        return self.store.get(job_id)

    async def resume(self, rebuild: Callable[[ImageJob], Awaitable[Accepted]]) -> None:
        """Once the engine serves, run again the jobs a previous server left unfinished;
        ``rebuild(job)`` validates a stored job's body as its route does."""
        left = self.store.unfinished()
        if not left:
            return
        while not self.serving.scheduler.ready:
            await asyncio.sleep(READY_POLL_S)
        log.warning("resuming %d image jobs left unfinished by the last server", len(left))
        for job in left:
            try:
                accepted = await rebuild(job)
            except APIError as error:  # the server's limits changed since it was accepted
                self._finish(job, accepted_body_of(job), status=FAILED,
                             error=error.body()["error"])
                continue
            except Exception as error:  # noqa: BLE001 - this job fails, the others resume
                log.exception("image job %s could not be resumed", job.id)
                self._finish(job, accepted_body_of(job), status=FAILED, error={
                    "message": f"The job could not be resumed: {error}", "type": "server_error",
                    "param": None, "code": "internal_error"})
                continue
            self.store.update(job.id, status=QUEUED)
            self._start(job, accepted)


def accepted_body_of(job: ImageJob):
    """A stored job's webhook settings, where its body no longer validates."""
    request = job.body.get("request", {})
    return dataclasses.make_dataclass("Stored", ["webhook", "webhook_events_filter"])(
        request.get("webhook"), request.get("webhook_events_filter"))
