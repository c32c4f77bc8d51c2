"""Every accepted request gets exactly one answer: overload, timeouts, disconnects, crashes,
shutdown. Each test drives the real server: real processes, real signals, real sockets."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server import (
    LAUNCHES,
    Server,
    assert_openai_error,
    descendants,
    hanging_up,
    metric,
    pids_titled,
    serves,
    session_members,
    spec,
    wait_for_metric,
)
from pace import scaled

# Long enough (seconds on a small CPU) to act while it runs.
SLOW = {"prompt": "a slow one", "num_inference_steps": 150, "seed": 1}
FAST = {"prompt": "a quick one", "num_inference_steps": 2, "seed": 2}
GENERATE = "/v1/images/generations"


def post(server: Server, body: dict, timeout: float = 120) -> httpx.Response:
    with server.client(timeout=timeout) as c:
        return c.post(GENERATE, json=body)


def wait_running(server: Server, count: int = 1) -> None:
    wait_for_metric(server, "diffserve_num_requests_running", lambda v: v >= count)


MODES = ["step", "request"]


@pytest.fixture(scope="module", params=MODES)
@serves(lambda mode: spec("--dynamic-batch-max-size", "1", "--max-inference-steps", "1000",
                          "--max-queue-size", "2", "--request-timeout-s", "300",
                          "--batching-mode", mode))
def serial_server(request):
    """Batches of one image, so a slow request holds the executor while others queue."""
    srv = LAUNCHES.take(request).start()
    srv.mode = request.param
    yield srv
    assert srv.stop() == 0, srv.log


def test_overload_gets_429_with_retry_after_and_accepted_requests_complete(serial_server):
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, serial_server, SLOW)
        wait_running(serial_server)
        with ThreadPoolExecutor(6) as burst:
            responses = list(burst.map(lambda i: post(serial_server, {**FAST, "seed": i}), range(6)))
        assert slow.result().status_code == 200
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) == 2 and statuses.count(429) == 4, statuses  # 2 = --max-queue-size
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert_openai_error(r, 429, code="overloaded")
    text = httpx.get(serial_server.url + "/metrics").text
    assert metric(text, "diffserve_requests_total", status="rejected") >= 4


def test_queued_request_of_a_departed_client_never_runs(serial_server):
    with serial_server.client() as c:
        before = c.get("/metrics").text
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, serial_server, SLOW)
        wait_running(serial_server)
        # The client hangs up once its request is queued (a client timeout instead could fire
        # before a busy server had even queued it).
        with hanging_up(serial_server, {**FAST, "prompt": "abandoned"}):
            wait_for_metric(serial_server, "diffserve_num_requests_waiting", lambda v: v >= 1)
        wait_for_metric(serial_server, "diffserve_requests_cancelled_total",
                        lambda v: v > metric(before, "diffserve_requests_cancelled_total"))
        assert slow.result().status_code == 200
    with serial_server.client() as c:
        after = c.get("/metrics").text
    assert metric(after, "diffserve_batch_size_count") - metric(before, "diffserve_batch_size_count") == 1
    assert metric(after, "diffserve_requests_total", status="cancelled") > metric(
        before, "diffserve_requests_total", status="cancelled")


def test_running_work_stops_early_when_its_only_client_leaves(serial_server):
    # Request mode stops the pipeline call; step mode drops the request from the running set.
    name, labels = (("diffserve_batches_interrupted_total", {}) if serial_server.mode == "request"
                    else ("diffserve_step_retirements_total", {"outcome": "cancelled"}))
    with pytest.raises(httpx.ReadTimeout):
        with serial_server.client(timeout=httpx.Timeout(120, read=1.0)) as c:
            r = c.post(GENERATE, json={**SLOW, "num_inference_steps": 900})
            pytest.fail(f"answered before the client left: {r.status_code} {r.text}")
    started = time.monotonic()
    wait_for_metric(serial_server, name, lambda v: v >= 1, **labels)
    # 900 steps take far longer than this; the interrupt lands at the next step.
    assert time.monotonic() - started < 10
    assert post(serial_server, FAST).status_code == 200


@pytest.mark.server("--dynamic-batch-max-size", "1", "--max-inference-steps", "1000",
                    "--request-timeout-s", "0.5")
def test_request_waiting_past_the_timeout_gets_503_and_never_runs(own_server):
    with own_server as srv:
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(post, srv, SLOW)
            wait_running(srv)
            late = post(srv, FAST)
            assert slow.result().status_code == 200
        assert_openai_error(late, 503, code="timeout")
        assert "--request-timeout-s" in late.json()["error"]["message"]
        text = httpx.get(srv.url + "/metrics").text
        assert metric(text, "diffserve_images_generated_total") == 1


def test_executor_crash_fails_its_requests_fast_restarts_and_runs_the_queue(serial_server):
    """The last test of its server: the executor it kills is restarted once. The request it held
    streams previews, so it cannot simply run again: it is answered 503 at once (a request that
    emitted nothing runs again: tests/test_data_parallel.py)."""
    srv = serial_server
    (executor,) = pids_titled(srv.proc.pid, "diffserve::executor")
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(post, srv, {**SLOW, "stream": True, "partial_images": 1})
        wait_running(srv)
        queued = pool.submit(post, srv, FAST)
        wait_for_metric(srv, "diffserve_num_requests_waiting", lambda v: v >= 1)
        killed_at = time.monotonic()
        os.kill(executor, signal.SIGKILL)
        failed = slow.result()
        answered_in = time.monotonic() - killed_at
        health = httpx.get(srv.url + "/health")
        done = queued.result()
    assert_openai_error(failed, 503, code="executor_restarted")
    assert "executor" in failed.json()["error"]["message"]
    assert answered_in < 2.0, f"answered {answered_in:.2f} s after the executor died"
    assert health.status_code == 503
    assert health.json()["executors"][0]["state"] in ("restarting", "starting")
    assert done.status_code == 200, done.text  # the queued one ran on the new executor
    assert httpx.get(srv.url + "/health").status_code == 200
    assert pids_titled(srv.proc.pid, "diffserve::executor") != [executor]
    assert httpx.get(srv.url + "/health").json()["executors"][0]["restarts"] == 1
    text = httpx.get(srv.url + "/metrics").text
    assert metric(text, "diffserve_executor_restarts_total", executor="0") == 1


@pytest.mark.server("--max-inference-steps", "1000")
def test_scheduler_crash_answers_503_and_the_server_exits_nonzero(own_server):
    srv = own_server.start()
    root = srv.proc.pid
    try:
        (scheduler,) = pids_titled(root, "diffserve::scheduler")
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(post, srv, SLOW)
            wait_running(srv)
            killed_at = time.monotonic()
            os.kill(scheduler, signal.SIGKILL)
            response = slow.result()
            answered_in = time.monotonic() - killed_at
        assert_openai_error(response, 503)
        assert answered_in < 2.0
        assert srv.proc.wait(scaled(30)) == 1
        assert session_members(root) == [], "processes left behind"  # the executor died with its parent
    finally:
        srv.stop()


@pytest.mark.parametrize("mode", ["step", "request"])
@pytest.mark.parametrize("target", ["frontend", "group"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.server("--dynamic-batch-max-size", "1", "--shutdown-timeout-s", "600",
                    "--batching-mode", "{mode}", "--stages", "on")
def test_graceful_shutdown_finishes_accepted_work_and_exits_0(sig, target, mode, own_server):
    """Either signal, to the frontend alone or to the whole process group (Ctrl-C in a terminal;
    `systemctl stop` with systemd's default KillMode=control-group), drains the same way (in
    step mode, what the encode and decode stages hold too; request mode has none)."""
    srv = own_server.start()
    root = srv.proc.pid
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post, srv, {**SLOW, "num_inference_steps": 60})]
        wait_running(srv)
        futures += [pool.submit(post, srv, {**FAST, "seed": i}) for i in range(2)]
        wait_for_metric(srv, "diffserve_num_requests_waiting", lambda v: v >= 2)
        if target == "group":
            os.killpg(root, sig)  # the server runs in a session (and group) of its own
        else:
            srv.proc.send_signal(sig)
        assert srv.wait_for_line("finishing accepted requests")
        try:
            late = post(srv, FAST, timeout=5)
            assert_openai_error(late, 503, code="shutting_down")
            # Checked before the body is read: an edit is refused without decoding its upload.
            with srv.client(timeout=5) as c:
                edit = c.post("/v1/images/edits", files={"image": ("x.png", b"not an image")},
                              data={"prompt": "x"})
            assert_openai_error(edit, 503, code="shutting_down")
        except httpx.TransportError:
            pass  # the listener is closed already: refused, which is also "not accepted"
        assert [f.result().status_code for f in futures] == [200, 200, 200]
    assert srv.proc.wait(scaled(60)) == 0, srv.log
    assert session_members(root) == [], "processes left behind"
    assert " ERROR " not in srv.log and "leaked" not in srv.log, srv.log


@pytest.mark.server("--dynamic-batch-max-size", "1", "--max-inference-steps", "1000",
                    "--shutdown-timeout-s", "0.5")
def test_shutdown_timeout_answers_what_is_left_with_503(own_server):
    srv = own_server.start()
    root = srv.proc.pid
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(post, srv, {**SLOW, "num_inference_steps": 900})
        wait_running(srv)
        queued = pool.submit(post, srv, FAST)
        wait_for_metric(srv, "diffserve_num_requests_waiting", lambda v: v >= 1)
        srv.proc.send_signal(signal.SIGTERM)
        assert_openai_error(slow.result(), 503)
        assert_openai_error(queued.result(), 503)
    assert srv.proc.wait(scaled(60)) == 0, srv.log
    assert session_members(root) == [], "processes left behind"


KEY = "s3cret-key"


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.server(lambda how: spec("--api-key", KEY) if how == "flag"
                    else spec(env={"DIFFSERVE_API_KEY": KEY}))
def test_api_key_guards_v1_only(how, own_server):
    key = KEY
    with own_server as srv, srv.client() as c:
        assert_openai_error(c.post(GENERATE, json=FAST), 401, code="invalid_api_key")
        assert_openai_error(c.get("/v1/models"), 401)
        for bad in ("Bearer wrong", "Basic " + key, key, "Bearer " + key + "x"):
            assert_openai_error(c.post(GENERATE, json=FAST, headers={"Authorization": bad}), 401)
        ok = c.post(GENERATE, json=FAST, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        assert key not in srv.log


@pytest.mark.server("--max-body-bytes", "2048")
def test_oversized_body_gets_413_naming_the_flag_that_bounds_it(own_server):
    with own_server as srv, srv.client() as c:
        r = c.post(GENERATE, content=b'{"prompt": "' + b"x" * 4096 + b'"}')
        error = assert_openai_error(r, 413, code="request_too_large")
        assert "--max-body-bytes" in error["message"], error
        assert c.post(GENERATE, json=FAST).status_code == 200


@pytest.mark.server()
def test_children_die_with_a_killed_frontend(own_server):
    srv = own_server.start()
    children = descendants(srv.proc.pid)
    assert len(children) >= 2
    srv.proc.kill()
    srv.proc.wait(scaled(30))
    deadline = time.monotonic() + scaled(30)
    while any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in children):
        assert time.monotonic() < deadline, "scheduler/executor outlived the frontend"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
