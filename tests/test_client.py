"""diffserve.client's retry rules, against a scripted HTTP server on loopback (the client's own
logic; the live server's 429s and rollouts are in test_rollouts.py): it waits what Retry-After
says, backs off without one, retries a refused connection, gives up after its retries, and
wraps per-prompt seeds as the server does."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from safetensors.numpy import save

from diffserve.client import Client, RolloutError
from diffserve.ports import free_port


class Script:
    """Answers POSTs with ``answers`` in turn: (status, headers); 200 carries a rollout body."""

    def __init__(self, answers):
        self.answers, self.times, self.bodies = list(answers), [], []

    def serve(self, port: int = 0):
        script = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the library's name
                script.times.append(time.monotonic())
                script.bodies.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                status, headers = script.answers.pop(0) if script.answers else (200, {})
                body = (save({"log_probs": np.zeros((1, 2), np.float32)},
                             metadata={"request": json.dumps(script.bodies[-1]), "seeds": "[7]"})
                        if status == 200 else json.dumps({"error": {"message": "busy"}}).encode())
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def script():
    scripts = []

    def make(*answers):
        scripts.append(Script(answers))
        return scripts[-1]

    yield make
    for s in scripts:
        if hasattr(s, "server"):
            s.server.shutdown()


def test_429_and_503_wait_what_retry_after_says(script):
    s = script((429, {"Retry-After": "0.4"}), (503, {"Retry-After": "0.2"}))
    with Client(s.serve(), backoff_s=5.0) as client:
        got = client.rollout_one({"prompt": "x"})
    assert got.seeds == [7] and got.log_probs.shape == (1, 2)
    gaps = np.diff(s.times)
    assert len(s.times) == 3 and 0.4 <= gaps[0] < 2.0 and 0.2 <= gaps[1] < 2.0


def test_without_retry_after_it_backs_off_exponentially_and_gives_up(script):
    s = script(*[(429, {})] * 3)
    with Client(s.serve(), backoff_s=0.1, max_retries=2) as client, \
            pytest.raises(RolloutError) as error:
        client.rollout_one({"prompt": "x"})
    assert error.value.status == 429 and len(s.times) == 3
    gaps = np.diff(s.times)
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2


def test_other_errors_are_not_retried(script):
    s = script((400, {}))
    with Client(s.serve()) as client, pytest.raises(RolloutError) as error:
        client.rollout_one({"prompt": "x"})
    assert error.value.status == 400 and "busy" in str(error.value) and len(s.times) == 1


def test_a_refused_connection_is_retried_until_the_server_is_up(script):
    port, s = free_port(), script()
    threading.Timer(0.3, s.serve, [port]).start()  # a server that is restarting
    with Client(f"http://127.0.0.1:{port}", backoff_s=0.1, max_retries=6) as client:
        got = client.rollout_one({"prompt": "x"})
    assert got.seeds == [7] and len(s.times) == 1


def test_per_prompt_seeds_are_consecutive_and_wrap_at_32_bits(script):
    s = script()
    with Client(s.serve()) as client:
        client.rollout(["a", "b", "c"], n=4, seed=2**32 - 6)
    seeds = sorted((b["prompt"], b["seed"]) for b in s.bodies)
    assert seeds == [("a", 2**32 - 6), ("b", 2**32 - 2), ("c", 2)]
