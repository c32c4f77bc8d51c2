"""Asynchronous image jobs through one real server: ``Prefer: respond-async`` answers 202 and a
Location, the job's answer equals the plain request's, its webhook events arrive signed (checked
with the secret), a receiver that is down is retried while the job still completes, and a
cancelled job never runs to the end. Every receiver is a tiny server on 127.0.0.1."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import http.server
import io
import json
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest
from PIL import Image

from diffserve.frontend.image_jobs.store import IN_PROGRESS, QUEUED, ImageJob, ImageJobStore
from server import LAUNCHES, assert_openai_error, decode, metric, serves, spec

SECRET = "whsec_" + base64.b64encode(b"a test secret of some length").decode()
GENERATIONS = "/v1/images/generations"
ASYNC = {"Prefer": "respond-async"}


def left_behind(directory: str) -> dict[str, dict]:
    """Jobs a previous server on ``directory`` left queued or running (as it would after being
    killed): the server started on it runs them again."""
    image = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 200, np.uint8)).save(image, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()
    bodies = {
        "imgjob_0000000000000001left": ("generations", {"prompt": "left queued", "seed": 8,
                                                         "num_inference_steps": 2}),
        "imgjob_0000000000000002left": ("edits", {"prompt": "left running", "seed": 9,
                                                   "num_inference_steps": 2, "strength": 0.5,
                                                   "images": [{"image_url": url}]})}
    store = ImageJobStore(directory)
    for status, (job_id, (route, body)) in zip((QUEUED, IN_PROGRESS), bodies.items()):
        store.insert(ImageJob(job_id, route, status, 1, {
            "request": body, "events": "image_generation", "base_url": "http://127.0.0.1:1/"}))
    return {job_id: body for job_id, (_, body) in bodies.items()}


JOB_DIR = tempfile.mkdtemp(prefix="diffserve-test-jobs-")
LEFT = left_behind(JOB_DIR)


@pytest.fixture(scope="module")
@serves(spec("--dynamic-batch-delay-ms", "20", "--webhook-secret", SECRET, "--image-dir", JOB_DIR,
             "--allowed-webhook-hosts", "127.0.0.1", "--image-ttl-s", "120",
             "--max-inference-steps", "1000"))
def server(request):
    with LAUNCHES.take(request) as srv:
        yield srv
    shutil.rmtree(JOB_DIR, ignore_errors=True)


def test_jobs_a_stopped_server_left_unfinished_are_run_by_the_next_one(server):
    with server.client() as c:
        for job_id, body in LEFT.items():
            done = finished(c, f"/v1/images/jobs/{job_id}")
            assert done["status"] == "completed", done
            assert done["result"]["data"][0]["seed"] == body["seed"]
        plain = c.post(GENERATIONS, json=LEFT["imgjob_0000000000000001left"]).json()
        resumed = c.get("/v1/images/jobs/imgjob_0000000000000001left").json()
    assert np.array_equal(decode(resumed["result"]["data"][0]["b64_json"]),
                          decode(plain["data"][0]["b64_json"]))


class Receiver:
    """Webhook posts, as received; the first ``failures`` are answered 503."""

    def __init__(self, failures: int = 0) -> None:
        self.posts: list[tuple[dict, bytes]] = []
        self.failures, self.lock = failures, threading.Lock()

    def verified(self) -> list[dict]:
        """The events whose signature checks with the secret (each delivered once)."""
        key = base64.b64decode(SECRET.removeprefix("whsec_"))
        found = {}
        for headers, body in self.posts:
            signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
            expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
            assert headers["webhook-signature"] == "v1," + expected
            found[headers["webhook-id"]] = json.loads(body)
        return list(found.values())


@contextlib.contextmanager
def receiver(failures: int = 0):
    got = Receiver(failures)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with got.lock:
                failing = got.failures > 0
                got.failures -= failing
                got.posts.append(({k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(503 if failing else 204)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/hook", got
    finally:
        httpd.shutdown()
        httpd.server_close()


def wait_until(check, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


def finished(c, location: str) -> dict:
    return wait_until(lambda: (job := c.get(location).json())["status"] not in (
        "queued", "in_progress") and job)


BODY = {"prompt": "a red circle", "seed": 21, "num_inference_steps": 3, "n": 2}


def test_a_job_with_a_webhook_answers_later_and_posts_signed_events(server):
    with receiver() as (url, got), server.client() as c:
        r = c.post(GENERATIONS, json={**BODY, "webhook": url}, headers=ASYNC)
        assert r.status_code == 202, r.text
        job = r.json()
        assert r.headers["location"] == f"/v1/images/jobs/{job['id']}"
        assert job["status"] in ("queued", "in_progress") and job["result"] is None
        done = finished(c, r.headers["location"])
        assert done["status"] == "completed", done
        plain = c.post(GENERATIONS, json=BODY).json()
        for mine, theirs in zip(done["result"]["data"], plain["data"]):
            assert mine["seed"] == theirs["seed"]
            assert np.array_equal(decode(mine["b64_json"]), decode(theirs["b64_json"]))
        events = wait_until(lambda: len(got.verified()) == 2 and got.verified())
    assert [e["type"] for e in events] == ["image.job.start", "image.job.completed"]
    assert events[1]["data"]["status"] == "completed" and events[1]["data"]["id"] == job["id"]
    assert events[1]["data"]["result"]["data"][0]["seed"] == 21


def test_a_receiver_that_is_down_is_retried_and_the_job_still_completes(server):
    with receiver(failures=2) as (url, got), server.client() as c:
        r = c.post(GENERATIONS, json={**BODY, "webhook": url,
                                      "webhook_events_filter": ["completed"]}, headers=ASYNC)
        assert r.status_code == 202, r.text
        assert finished(c, r.headers["location"])["status"] == "completed"
        wait_until(lambda: len(got.posts) == 3, 30)
        ids = {headers["webhook-id"] for headers, _ in got.posts}
    assert len(ids) == 1  # one event, delivered on its third try
    assert [e["type"] for e in got.verified()] == ["image.job.completed"]


def test_an_edit_job_and_previews_as_output_events(server):
    image = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 90, np.uint8)).save(image, format="PNG")
    with receiver() as (url, got), server.client() as c:
        r = c.post("/v1/images/edits", headers=ASYNC,
                   files={"image": ("in.png", image.getvalue(), "image/png")},
                   data={"prompt": "a blue square", "seed": "3", "num_inference_steps": "4",
                         "partial_images": "1", "webhook": url,
                         "webhook_events_filter": '["output", "completed"]'})
        assert r.status_code == 202, r.text
        assert finished(c, r.headers["location"])["status"] == "completed"
        events = wait_until(lambda: (v := got.verified()) and v[-1]["type"].endswith("completed")
                            and v)
    assert [e["type"] for e in events] == ["image.job.output", "image.job.completed"]
    assert decode(events[0]["data"]["b64_json"]).shape == (64, 64, 3)


def stopped(text: str) -> float:
    """Work the engine dropped: step mode retires it from the running set, request mode
    interrupts its pipeline call."""
    return (metric(text, "diffserve_step_retirements_total", outcome="cancelled")
            + metric(text, "diffserve_batches_interrupted_total"))


def test_a_cancelled_job_never_runs_to_the_end(server):
    with server.client() as c:
        def gauge(name: str) -> float:
            return metric(c.get("/metrics").text, name)

        made, dropped = gauge("diffserve_images_generated_total"), stopped(c.get("/metrics").text)
        with receiver() as (url, got):
            r = c.post(GENERATIONS, json={"prompt": "a slow one", "num_inference_steps": 900,
                                          "webhook": url}, headers=ASYNC)
            cancel_soon(c, r)
            events = wait_until(lambda: len(v := got.verified()) == 2 and v)
        assert [e["data"]["status"] for e in events] == ["in_progress", "cancelled"]
        location = r.headers["location"]
        wait_until(lambda: stopped(c.get("/metrics").text) > dropped, 60)
        wait_until(lambda: gauge("diffserve_num_requests_running") == 0, 30)
        assert c.get(location).json()["status"] == "cancelled"
        assert gauge("diffserve_images_generated_total") == made


def cancel_soon(c, r) -> None:
    """Cancel the job ``r`` answered once the engine runs it."""
    assert r.status_code == 202, r.text
    wait_until(lambda: metric(c.get("/metrics").text, "diffserve_num_requests_running") >= 1, 30)
    cancelled = c.delete(r.headers["location"]).json()
    assert cancelled["status"] == "cancelled" and cancelled["result"] is None


@pytest.mark.parametrize("body, headers, param", [
    ({"webhook": "http://127.0.0.1:9/h"}, {}, "webhook"),
    ({"webhook": "http://example.com/h"}, ASYNC, "webhook"),
    ({"webhook": "ftp://127.0.0.1/h"}, ASYNC, "webhook"),
    ({"webhook_events_filter": ["completed"]}, ASYNC, "webhook_events_filter"),
    ({"webhook": "http://127.0.0.1:9/h", "webhook_events_filter": ["done"]}, ASYNC,
     "webhook_events_filter[0]"),
    ({"stream": True}, ASYNC, "stream")])
def test_bad_job_requests_are_a_400(server, body, headers, param):
    with server.client() as c:
        assert_openai_error(c.post(GENERATIONS, json={"prompt": "x", **body}, headers=headers),
                            400, param)
        assert_openai_error(c.get("/v1/images/jobs/imgjob_none"), 404, code="job_not_found")
        assert_openai_error(c.delete("/v1/images/jobs/imgjob_none"), 404)


def test_the_python_client_and_the_sdk_hand_in_poll_and_cancel_jobs(server):
    import openai

    from diffserve.client import Client, RolloutError

    with receiver() as (url, got), Client(server.url) as client:
        job = client.submit_job(BODY, webhook=url, events=["completed"])
        done = client.wait_job(job["id"], poll_s=0.1, timeout_s=60)
        assert done["status"] == "completed" and done["result"]["data"][1]["seed"] == 22
        assert client.cancel_job(job["id"])["status"] == "completed"  # finished: left as it is
        wait_until(lambda: got.verified())
        with pytest.raises(RolloutError) as error:
            client.job("imgjob_none")
        assert error.value.status == 404
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    job = sdk.post("/images/generations", cast_to=object, body={**BODY, "num_inference_steps": 900},
                   options={"headers": {"Prefer": "respond-async"}})
    assert job["status"] in ("queued", "in_progress")
    assert sdk.get(f"/images/jobs/{job['id']}", cast_to=object)["id"] == job["id"]
    assert sdk.delete(f"/images/jobs/{job['id']}", cast_to=object)["status"] == "cancelled"
