"""Image jobs and url images without a server: the url store's cap and expiry, a job a server
left queued is run again by the next one on the same directory, and the webhook signature is the
Standard Webhooks one (its published example)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from diffserve.frontend.image_jobs.jobs import ImageJobs
from diffserve.frontend.image_jobs.store import COMPLETED, QUEUED, ImageJob, ImageJobStore
from diffserve.frontend.image_jobs.webhooks import Webhooks, secret_bytes, signature
from diffserve.frontend.image_store import ImageStore
from diffserve.frontend.scheduler_client import DoneEvent
from diffserve.frontend.schemas import ImageGenerationRequest
from diffserve.frontend.serving import Serving
from diffserve.wire.protocol import RequestDone
from diffserve.wire.request import ImageRequest


def test_the_signature_is_the_standard_webhooks_one():
    secret = secret_bytes("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    assert signature(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330,
                     b'{"test": 2432232314}') == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_url_images_expire_and_the_oldest_go_past_the_cap(tmp_path):
    now = [1000.0]
    store = ImageStore(str(tmp_path), ttl_s=10, max_bytes=2 << 20, clock=lambda: now[0])
    first = store.put(b"a" * (1 << 20), "png")
    second = store.put(b"b" * (1 << 20), "jpeg")
    assert store.get(first) == (b"a" * (1 << 20), "image/png")
    third = store.put(b"c" * 10, "webp")  # over the cap: the oldest goes
    assert store.get(first) is None and store.get(second)[1] == "image/jpeg"
    # A restart on the same directory keeps what is there.
    again = ImageStore(str(tmp_path), ttl_s=10, max_bytes=2 << 20, clock=lambda: now[0])
    assert again.get(third) == (b"c" * 10, "image/webp")
    now[0] += 11
    assert store.get(second) is None and store.get(third) is None
    assert list((tmp_path / "urls").iterdir()) == []


class Submission:
    def __init__(self, request: ImageRequest) -> None:
        self.request = request

    async def next(self):
        await asyncio.sleep(0)
        frame = np.full((self.request.height, self.request.width, 3), 7, np.uint8)
        return DoneEvent(RequestDone(self.request.request_id, [self.request.seed]),
                         [frame.tobytes()])

    def close(self) -> None:
        pass


def test_a_job_left_queued_is_run_by_the_next_server(tmp_path):
    left = ImageJobStore(tmp_path)
    body = {"prompt": "left behind", "seed": 5}
    left.insert(ImageJob("imgjob_1", "generations", QUEUED, 1, {
        "request": body, "events": "image_generation", "base_url": "http://127.0.0.1:1/"}))
    submitted = []

    async def submit(request, frames=()):
        submitted.append(request)
        return Submission(request)

    async def rebuild(job: ImageJob):
        parsed = ImageGenerationRequest.model_validate(job.body["request"])
        return ImageRequest("r1", "m", 8, 8, prompt=parsed.prompt, seed=parsed.seed), [], parsed

    async def main():
        info = SimpleNamespace(spatial_stride=8)
        scheduler = SimpleNamespace(ready=True, submit=submit, model_info=info,
                                    route=lambda name: (info, {}))
        from concurrent.futures import ThreadPoolExecutor
        serving = Serving(None, scheduler, None, ThreadPoolExecutor(1))
        jobs = ImageJobs(ImageJobStore(tmp_path), serving, Webhooks(""), ttl_s=60)
        await jobs.resume(rebuild)
        while jobs.running:
            await asyncio.sleep(0.01)
        return jobs.get("imgjob_1")

    job = asyncio.run(main())
    assert [r.prompt for r in submitted] == ["left behind"]
    assert job.status == COMPLETED and job.result["data"][0]["seed"] == 5


def test_a_multipart_edit_is_stored_as_the_json_edit_that_runs_it_again():
    from diffserve.frontend.image_routes import stored_edit
    from diffserve.frontend.image_urls import json_edit_inputs
    from diffserve.frontend.schemas import ImageEditForm, ImageEditJSON
    from diffserve.frontend.uploads import EditForm

    fields = {"prompt": "x", "n": "2", "strength": "0.5", "loras": '[{"name": "a", "scale": 0.5}]',
              "webhook_events_filter": '["completed"]'}
    form = EditForm(fields, [b"first", b"second"], b"mask")
    body = ImageEditForm.model_validate(fields)
    again = ImageEditJSON.model_validate(stored_edit(body, form))
    assert again.model_dump(exclude={"images", "mask"}) == body.model_dump()
    images, mask = asyncio.run(json_edit_inputs(again, (), 1 << 20))
    assert (images, mask) == ([b"first", b"second"], b"mask")
