"""The scheduler process itself, with real ZMQ sockets and processes: an error in its loop must
not leave it lingering (the frontend watches it to learn that the engine is gone)."""

from __future__ import annotations

import contextlib
import os

import zmq

from diffserve import metrics, processes
from diffserve.config.flags import ServerConfig
from diffserve.frontend.scheduler_client import SchedulerClient
from diffserve.wire.protocol import Kind, decode, encode
from diffserve.scheduler.service import SchedulerSpec, run_scheduler
from helpers import make_request, scheduler_failing_at_dispatch
from server import descendants
from pace import scaled


@contextlib.contextmanager
def scheduler_process(tmp_path, entry):
    """A real scheduler process started by ``entry`` on tiny-sd, and the frontend's end of its
    sockets (which binds both), once it is ready; stopped and cleaned up after."""
    ctx = zmq.Context()
    client = SchedulerClient(ctx, str(tmp_path))
    metrics_dir = metrics.prepare_directory()
    spec = SchedulerSpec(ServerConfig(model="tiny-sd", torch_threads=1), client.request_addr,
                         client.result_addr, str(tmp_path), metrics_dir, os.getpid())
    scheduler = processes.start(entry, spec, "diffserve::scheduler")
    try:
        client.wait_ready(scheduler.sentinel, 120)
        yield scheduler, client
    finally:
        processes.stop(scheduler)
        ctx.destroy(linger=0)
        metrics.remove_directory(metrics_dir)


def test_a_failing_scheduler_loop_stops_its_executors_and_exits(tmp_path):
    with scheduler_process(tmp_path, scheduler_failing_at_dispatch) as (scheduler, client):
        executors = descendants(scheduler.pid)
        assert executors
        client._out.send_multipart(encode(Kind.SUBMIT, make_request(model="tiny-sd")))
        scheduler.join(scaled(30))
        assert scheduler.exitcode == 1  # gone, so the frontend's watch on it fires
        assert not [pid for pid in executors if os.path.exists(f"/proc/{pid}")
                    and open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z"]


def test_a_request_whose_frames_are_not_its_manifests_is_answered_400(tmp_path):
    """The frames are checked where the message is decoded; the scheduler answers the request
    (it never waits for an answer that cannot come) and goes on serving."""
    with scheduler_process(tmp_path, run_scheduler) as (_, client):
        edit = make_request(request_id="no-frames", model="tiny-sd", task="image-to-image")
        client._out.send_multipart(encode(Kind.SUBMIT, edit))
        client._out.send_multipart(encode(Kind.SUBMIT, make_request(request_id="fine",
                                                                    model="tiny-sd")))
        answers = {}
        while len(answers) < 2 and client._in.poll(scaled(60) * 1000):
            kind, msg, _ = decode(client._in.recv_multipart())
            if kind in (Kind.REQUEST_FAILED, Kind.REQUEST_DONE):
                answers[msg.request_id] = (kind, msg)
        kind, failed = answers["no-frames"]
        assert (kind, failed.status, failed.code) == (Kind.REQUEST_FAILED, 400, "invalid_value")
        assert "declares 1 input frames (image[0]) but carries 0" in failed.message
        assert answers["fine"][0] is Kind.REQUEST_DONE
