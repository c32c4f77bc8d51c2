"""Small builders shared by the tests."""

from __future__ import annotations

import contextlib
import http.server
import itertools
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

from diffserve.wire.protocol import FAILED, FINISHED, REQUEST_MODE, ItemResult, ItemsDone
from diffserve.scheduler.core import SchedulerCore
from diffserve.wire.request import ImageRequest

_ids = itertools.count()
ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # the tools' own processes, one thread each


def run_tool(tool: str, *args: str, timeout: float = 300,
             expect_rc: int = 0) -> subprocess.CompletedProcess:
    """``benchmarks/TOOL *args`` run to its end; its exit status must be ``expect_rc``."""
    done = subprocess.run([sys.executable, str(BENCH / tool), *args], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == expect_rc, (
        f"{tool} {' '.join(args)} exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n"
        f"--- stderr\n{done.stderr[-3000:]}")
    return done


def check_report(result: dict, out: Path, name: str) -> dict:
    """A kit.servers.main tool's report (``out``: its --output-dir), checked for what every such report
    holds."""
    assert (out / f"{name}.md").read_text().startswith(f"# {name}:")
    assert json.loads((out / f"{name}.json").read_text()) == result
    (round_,) = result["rounds"]
    assert "error" not in round_["figures"]
    for one in round_["runs"]:
        assert one["completed"] + one["failed"] == one["config"]["num_prompts"]
    return result


def make_request(n: int = 1, *, request_id: str | None = None, width: int = 64, height: int = 64,
                 steps: int = 4, guidance: float = 5.0, prompt: str | None = None, seed: int = 0,
                 model: str = "tiny-sd", negative_prompt: str = "", task: str = "generate",
                 strength: float = 1.0, partial_images: int = 0, loras=(),
                 cost: float = 1.0, references: int = 0, scheduler: str = "",
                 priority: int = 0, controls=()) -> ImageRequest:
    rid = request_id or f"r{next(_ids)}"
    return ImageRequest(request_id=rid, model=model, width=width, height=height, task=task,
                        num_inference_steps=steps, guidance_scale=guidance, strength=strength,
                        prompt=prompt or f"prompt of {rid}", negative_prompt=negative_prompt,
                        seed=seed, n=n, partial_images=partial_images, loras=tuple(loras),
                        cost=cost, references=references, scheduler=scheduler,
                        priority=priority, controls=tuple(controls))


def ready_core(max_size=4, delay=0.0, executors=1, mode=REQUEST_MODE, **kw) -> SchedulerCore:
    """A scheduler core whose ``executors`` are ready at time 0."""
    c = SchedulerCore(max_size, delay, executors, mode=mode, **kw)
    for i in range(executors):
        c.executor_ready(i, 0.0)
    return c


def run(c, d, errors=None, only=None, now=1.0, seconds=0.1, status=None):
    """Answer dispatch ``d`` like an executor. ``only``: answer just these request ids (a step
    engine retiring part of its set)."""
    errors = errors or {}
    results = []
    for item in d.work.items:
        rid = item.request.request_id
        if only is not None and rid not in only:
            continue
        if rid in errors:
            results.append(ItemResult(rid, item.start, item.stop, FAILED, seconds, errors[rid]))
            continue
        results.append(ItemResult(rid, item.start, item.stop, status or FINISHED, seconds, None, 7))
    return c.complete(d.executor, ItemsDone(results), now)


def taken(dispatches):
    return [[(i.request.request_id, i.start, i.stop) for i in d.work.items] for d in dispatches]


def run_plan(engine, plan: dict) -> dict:
    """Drive a step engine: ``plan[step]`` lists (request, input frames) admitted before that
    step; every request must finish. Each request's images, by request id."""
    import select

    from diffserve.wire.request import WorkItem

    images, step = {}, 0
    while step == 0 or engine:
        if step > max(plan) and not engine.steppable and getattr(engine, "wakeup", None):
            # Only stage work is left (threaded stages): wait for a stage's notice.
            assert select.select([engine.wakeup.read_fd], [], [], 600)[0], "a stage job hangs"
            engine.wakeup.clear()
        if step in plan:
            failed = engine.admit([WorkItem(r, 0, r.n) for r, _ in plan[step]],
                                  [frames for _, frames in plan[step]])
            assert not failed, [f.error for f in failed]
        for o in engine.step().finished:
            assert o.error is None, o.error
            images[o.item.request.request_id] = o.images
        step += 1
    return images


def exit_with(code: int) -> None:
    """A process entry that exits at once with ``code`` (a stand-in executor that crashes)."""
    import os

    os._exit(code)


def scheduler_failing_at_dispatch(spec) -> None:
    """The real scheduler process entry, with a fault injected: its loop raises as soon as a
    request waits to be dispatched (a stand-in for any bug in the loop)."""
    from diffserve.scheduler import service

    def fail(self, now):
        if self.core.num_waiting:
            raise RuntimeError("injected fault in the scheduler loop")

    service.SchedulerProc._dispatch = fail
    service.run_scheduler(spec)


def sde_log_prob(x, v, nxt, sigmas, step: int, a: float) -> float:
    """A trainer's log-probability of the recorded next latent ``nxt`` (float64 tensors) under
    Flow-GRPO's SDE step from ``x`` with velocity ``v`` at noise level ``a``, per element."""
    s_t, s_n = sigmas[step], sigmas[step + 1]
    d = s_n - s_t
    s = a * math.sqrt(s_t / (1 - (sigmas[1] if s_t >= 1 else s_t)))
    mean = x.double() * (1 + s * s * d / (2 * s_t)) + v * (1 + s * s * (1 - s_t) / (2 * s_t)) * d
    std = s * math.sqrt(-d)
    return (-((nxt - mean) ** 2) / (2 * std * std) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean().item()


@contextlib.contextmanager
def image_host(status: int = 200, body: bytes = b"", location: str | None = None):
    """A tiny HTTP server on 127.0.0.1 that answers every GET with ``status`` and ``body`` (and a
    ``Location``, for a redirect); the URL of an image on it."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            if location:
                self.send_header("Location", location)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/in.png"
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextlib.contextmanager
def rows_per_forward(family):
    """The rows each denoiser forward of ``family`` carries while the block runs (a list that
    grows as they run)."""
    seen, real = [], family.forward

    def forward(latents, *rest, **kwargs):
        seen.append(latents.shape[0])
        return real(latents, *rest, **kwargs)

    family.forward = forward
    try:
        yield seen
    finally:
        family.forward = real


def psnr(a, b) -> float:
    """Peak signal-to-noise ratio of two uint8 arrays, in dB (inf where they are equal)."""
    import numpy as np

    mse = np.mean((a.astype(float) - b.astype(float)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)
