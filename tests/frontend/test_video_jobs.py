"""Video jobs without a server: the job table and the job runner against a stand-in engine. A
full disk fails the job that hit it, with a clear error, and no other; expired jobs go with
their files; a store is held by one server at a time."""

from __future__ import annotations

import asyncio
import errno
import time

import numpy as np
import pytest

from diffserve.frontend.scheduler_client import DoneEvent, ProgressEvent
from diffserve.frontend.videos.jobs import VideoJobs, new_id
from diffserve.frontend.videos.store import COMPLETED, FAILED, StoreBusy, VideoStore
from diffserve.metrics import FrontendMetrics
from diffserve.wire.request import ImageRequest
from diffserve.wire.protocol import RequestDone

FRAMES, SIDE, STEPS = 5, 16, 4


class Submission:
    def __init__(self, request: ImageRequest) -> None:
        frames = np.full((FRAMES, SIDE, SIDE, 3), request.seed, np.uint8)
        self.events = [ProgressEvent(i, STEPS) for i in range(1, STEPS + 1)]
        self.events.append(DoneEvent(RequestDone(request.request_id, [request.seed]),
                                     [frames.tobytes()]))

    async def next(self):
        await asyncio.sleep(0)
        return self.events.pop(0)

    def close(self) -> None:
        pass


class Engine:
    async def submit(self, request, frames=()):
        return Submission(request)


def request(seed: int) -> ImageRequest:
    return ImageRequest(new_id(), "tiny-wan", SIDE, SIDE, prompt=f"video {seed}", seed=seed,
                        num_frames=FRAMES, progress=True)


def run_jobs(store, requests, ttl_s=3600.0):
    async def main():
        jobs = VideoJobs(store, Engine(), FrontendMetrics().video, ttl_s, 8)
        for r in requests:
            jobs.create(r, [], {"fps": 8}, "0.625")
        while jobs.running:
            await asyncio.sleep(0.01)
        jobs.pool.shutdown(wait=True)
        return jobs

    return asyncio.run(main())


def test_a_full_disk_fails_only_the_job_that_hit_it(tmp_path, monkeypatch):
    from diffserve.frontend.videos import encode

    real = encode.encode_mp4
    full, fine = request(1), request(2)

    def encode_mp4(frames, fps, path):
        if path.name.startswith(full.request_id):
            path.write_bytes(b"half an mp4")  # what it got to write before the disk filled
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(frames, fps, path)

    monkeypatch.setattr(encode, "encode_mp4", encode_mp4)
    store = VideoStore(tmp_path)
    run_jobs(store, [full, fine])
    failed, done = store.get(full.request_id), store.get(fine.request_id)
    assert failed.status == FAILED and failed.error_code == "storage_full"
    assert "No space left on device" in failed.error_message and "full" in failed.error_message
    assert done.status == COMPLETED and done.progress == 100
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted(
        f"{fine.request_id}{suffix}" for suffix in (".mp4", ".spritesheet.jpg", ".thumbnail.webp"))


def test_expired_jobs_and_their_files_are_removed(tmp_path):
    store = VideoStore(tmp_path)
    jobs = run_jobs(store, [request(3)], ttl_s=1.0)
    (job,) = store.page(None, 10, True)[0]
    assert job.expires_at <= int(time.time()) + 1
    time.sleep(1.1 + job.expires_at - time.time())
    jobs.sweep()
    assert store.get(job.id) is None and not list((tmp_path / "files").iterdir())


def test_one_server_holds_a_store_and_a_reopened_one_fails_what_was_running(tmp_path):
    store = VideoStore(tmp_path)
    with pytest.raises(StoreBusy):
        VideoStore(tmp_path)
    running = request(4)
    from diffserve.frontend.videos.store import IN_PROGRESS, VideoJob

    store.insert(VideoJob(running.request_id, IN_PROGRESS, 40, int(time.time()), "m", "p", "1", "16x16"))
    store.close()
    reopened = VideoStore(tmp_path)
    job = reopened.get(running.request_id)
    assert (job.status, job.error_code) == (FAILED, "server_restarted")
    assert reopened.interrupted == [running.request_id]
