"""The scheduler process itself, with real ZMQ sockets and processes: an error in its loop must
not leave it lingering (the frontend watches it to learn that the engine is gone)."""

from __future__ import annotations

import os

import zmq

from diffserve import metrics, processes
from diffserve.config import ServerConfig
from diffserve.frontend.engine_client import EngineClient
from diffserve.protocol import Kind, encode
from diffserve.scheduler.process import SchedulerSpec
from helpers import make_request, scheduler_failing_at_dispatch
from server import descendants
from pace import scaled


def test_a_failing_scheduler_loop_stops_its_executors_and_exits(tmp_path):
    ctx = zmq.Context()
    client = EngineClient(ctx, str(tmp_path))  # the frontend's end: binds both sockets
    metrics_dir = metrics.prepare_directory()
    spec = SchedulerSpec(ServerConfig(model="tiny-sd", torch_threads=1), client.request_addr,
                         client.result_addr, str(tmp_path), metrics_dir, os.getpid())
    scheduler = processes.start(scheduler_failing_at_dispatch, spec, "diffserve::scheduler")
    try:
        client.wait_ready(scheduler.sentinel, 120)
        executors = descendants(scheduler.pid)
        assert executors
        client._out.send_multipart(encode(Kind.SUBMIT, make_request(model="tiny-sd")))
        scheduler.join(scaled(30))
        assert scheduler.exitcode == 1  # gone, so the frontend's watch on it fires
        assert not [pid for pid in executors if os.path.exists(f"/proc/{pid}")
                    and open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z"]
    finally:
        processes.stop(scheduler)
        ctx.destroy(linger=0)
        metrics.remove_directory(metrics_dir)
