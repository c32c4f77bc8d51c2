"""Video jobs in the frontend: each is a row in the store from the moment it is accepted, and a
task that runs it through the engine as one request (one sample whose result is its frames),
follows its progress, encodes its files off the event loop and records how it ended.

Progress is 0-100: the denoising steps done over the total fill 0..90 (the executor reports
them, rate-limited), the frames arriving (decoded) make it 95, the stored files 100.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from diffserve.errors import APIError, engine_error
from diffserve.frontend.scheduler_client import DoneEvent, SchedulerClient, ProgressEvent
from diffserve.frontend.videos.encode import Sound, remove_files, write_files
from diffserve.frontend.videos.store import COMPLETED, FAILED, IN_PROGRESS, QUEUED, VideoJob, VideoStore
from diffserve.metrics import VIDEO_STATUSES, VideoMetrics
from diffserve.wire.request import ImageRequest

log = logging.getLogger(__name__)

DENOISED = 90  # progress once every step is done
DECODED = 95  # once the frames are at the frontend
SWEEP_S = 60.0  # how often expired jobs are looked for


def new_id(owner: str = "") -> str:
    """``video_``, the creation time (fixed-width hex nanoseconds: ids sort by creation), a
    random part, then the tag of the replica that holds the job (none on a single server)."""
    return f"video_{time.time_ns():016x}{uuid.uuid4().hex[:12]}{owner}"


class VideoJobs:
    def __init__(self, store: VideoStore, scheduler: SchedulerClient, metrics: VideoMetrics,
                 ttl_s: float, max_queued: int) -> None:
        self.store, self.scheduler, self.metrics = store, scheduler, metrics
        self.ttl_s, self.max_queued = ttl_s, max_queued
        self.running: dict[str, asyncio.Task] = {}  # job id -> its task (queued or in progress)
        self.queued: set[str] = set()
        # Encoding is CPU work of its own: one video at a time, beside the event loop.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="video-encode")
        self._sweeper: asyncio.Task | None = None
        self.sweep()

    def create(self, request: ImageRequest, inputs: list, params: dict, seconds: str) -> VideoJob:
        """Accept a job (429 past --max-video-jobs queued): stored as queued, then run."""
        if len(self.queued) >= self.max_queued:
            raise engine_error(429, f"The server is overloaded: {len(self.queued)} video jobs are "
                               "queued already (--max-video-jobs); retry later.",
                               "server_error", "overloaded")
        job = self.store.insert(VideoJob(
            request.request_id, QUEUED, 0, int(time.time()), request.model, request.prompt,
            seconds, f"{request.width}x{request.height}", params))
        self.queued.add(job.id)
        loop = asyncio.get_running_loop()
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep_forever())
        self.running[job.id] = loop.create_task(self._run(job, request, inputs))
        self.count_jobs()
        return job

    async def _run(self, job: VideoJob, request: ImageRequest, inputs: list) -> None:
        started = None
        try:
            submission = await self.scheduler.submit(request, inputs)
            try:
                while True:
                    event = await submission.next()
                    if isinstance(event, ProgressEvent):
                        if started is None:
                            started = time.time()
                            self.queued.discard(job.id)
                            self.metrics.queue_seconds.observe(started - job.created_at)
                            self.store.update(job.id, status=IN_PROGRESS)
                            self.count_jobs()
                        done = event.done * DENOISED // max(event.total, 1)
                        self.store.update(job.id, progress=done)
                    elif isinstance(event, DoneEvent):
                        break
            finally:
                submission.close()  # a job cancelled meanwhile leaves the engine at its next step
            self.queued.discard(job.id)
            self.store.update(job.id, status=IN_PROGRESS, progress=DECODED)
            frames = np.frombuffer(event.frames[0], np.uint8).reshape(
                request.num_frames, request.height, request.width, 3)
            track = event.sounds[0] if event.sounds else None
            sound = None
            if track is not None and job.params.get("audio"):
                samples, channels, rate = track
                sound = Sound(np.frombuffer(samples, np.float32).reshape(channels, -1), rate)
            job.params["audio"] = sound is not None  # request mode answers frames alone
            await asyncio.get_running_loop().run_in_executor(
                self.pool, write_files, frames, job.params["fps"], self.store.stem(job.id), sound)
        except asyncio.CancelledError:
            raise
        except APIError as error:
            self._fail(job, error.code or error.type, error.message)
        except OSError as error:
            full = error.errno in (errno.ENOSPC, errno.EDQUOT)
            log.error("could not store video %s: %s", job.id, error)
            self._fail(job, "storage_full" if full else "storage_error",
                       f"The video was made but could not be stored: {error.strerror or error}"
                       + (" (the server's video directory is full)" if full else ""))
        except Exception as error:  # noqa: BLE001 - this job fails, the server goes on
            log.exception("video job %s failed", job.id)
            self._fail(job, "server_error", f"{type(error).__name__}: {error}")
        else:
            now = int(time.time())
            job.params["weight_version"] = event.done.weight_version
            self.store.update(job.id, status=COMPLETED, progress=100, completed_at=now,
                              expires_at=now + int(self.ttl_s) if self.ttl_s else None,
                              params=json.dumps(job.params))
            self.metrics.finished_total.labels(status=COMPLETED).inc()
            self.metrics.video_seconds_total.inc(request.num_frames / job.params["fps"])
            self.metrics.run_seconds.observe(time.time() - (started or job.created_at))
        finally:
            self.queued.discard(job.id)
            self.running.pop(job.id, None)
            self.count_jobs()

    def _fail(self, job: VideoJob, code: str, message: str) -> None:
        now = int(time.time())
        self.store.update(job.id, status=FAILED, completed_at=now, error_code=code,
                          error_message=message,
                          expires_at=now + int(self.ttl_s) if self.ttl_s else None)
        self.metrics.finished_total.labels(status=FAILED).inc()

    async def delete(self, job_id: str) -> bool:
        """Cancel a queued or running job (it stops at its next step) or remove a finished one's
        files; either way the job is gone. False for an unknown id."""
        if self.store.get(job_id) is None:
            return False
        task = self.running.get(job_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.metrics.finished_total.labels(status="cancelled").inc()
            # Through the encoding thread, behind an encode of this job already under way (a
            # cancelled await does not stop it), so that nothing it writes outlives the job.
            await asyncio.get_running_loop().run_in_executor(
                self.pool, remove_files, self.store.stem(job_id))
        self._remove(job_id)
        return True

    def _remove(self, job_id: str) -> None:
        self.store.delete(job_id)
        remove_files(self.store.stem(job_id))
        self.count_jobs()

    def sweep(self) -> None:
        """Remove the jobs whose files have expired (--video-ttl-s)."""
        for job_id in self.store.expired(int(time.time())):
            if job_id not in self.running:
                self._remove(job_id)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(SWEEP_S, self.ttl_s or SWEEP_S))
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - try again at the next sweep
                log.exception("sweeping expired videos failed")

    def count_jobs(self) -> None:
        counts = self.store.counts()
        for status in VIDEO_STATUSES:
            self.metrics.jobs.labels(status=status).set(counts.get(status, 0))
