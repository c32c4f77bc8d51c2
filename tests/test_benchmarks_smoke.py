"""Smoke runs of the tools in benchmarks/, so that they cannot rot.

Each tool runs as a subprocess with tiny settings (a few requests, concurrency 2, tiny-sd,
batches of at most 2, one denoising step) and must exit 0 with sane output. These are not
measurements: nothing here checks a speed. Intra-op threads are pinned to 1 so that the runs
stay quick on a small machine that is busy with other work.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TOOLS = ["bench_serving.py", "bench_offline.py", "compare.py", "naive_server.py", "models.py",
         "bench_batcher.py"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    cache = os.environ.get("DIFFSERVE_CACHE_DIR") or str(tmp_path_factory.mktemp("diffserve-cache"))
    return dict(os.environ, DIFFSERVE_CACHE_DIR=cache, OMP_NUM_THREADS="1",
                TRANSFORMERS_VERBOSITY="error", DIFFUSERS_VERBOSITY="error")


def run_tool(tool: str, *args: str, env: dict[str, str], timeout: float = 120,
             expect_rc: int = 0) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(BENCH / tool), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == expect_rc, (
        f"{tool} {' '.join(args)} exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n"
        f"--- stderr\n{done.stderr[-3000:]}")
    return done


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode} before it was healthy"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    pytest.fail(f"server at {url} was not healthy within {deadline_s} s")


@pytest.fixture(scope="module", autouse=True)
def diffserve_server(env, tmp_path_factory):
    """A diffserve server (tiny-sd, batches of at most 2), launched when the module starts so
    that it loads while the other tests run; always stopped. Yields (url, process, log)."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "diffserve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "diffserve", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--model", "tiny-sd", "--dynamic-batch-max-size", "2", "--dynamic-batch-delay-ms", "8",
             "--torch-threads", "1", "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}", proc, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def diffserve_url(diffserve_server) -> str:
    url, proc, log = diffserve_server
    try:
        wait_healthy(url, proc, 120)
    except BaseException:
        print(log.read_text(errors="replace")[-3000:])
        raise
    return url


@pytest.mark.parametrize("tool", TOOLS)
def test_help(tool, env):
    done = run_tool(tool, "--help", env=env, timeout=60)
    assert "usage:" in done.stdout


def test_bench_batcher(env, tmp_path):
    out = tmp_path / "batcher.json"
    done = run_tool("bench_batcher.py", "--cycles", "500", "--repeats", "1", "--backlog-depth",
                    "20,200", "--output-file", str(out), env=env)
    assert "decisions/s" in done.stdout
    report = json.loads(out.read_text())
    assert [r["scenario"] for r in report["results"]] == ["stream", "backlog", "backlog"]
    for r in report["results"]:
        assert r["decisions"] == 500 and r["decisions_per_s"] > 0
        assert 1 <= r["mean_batch_size"] <= 8


def test_models_builder(env, tmp_path):
    out = tmp_path / "model"
    done = run_tool("models.py", "--out", str(out), "--unet-channels", "32,64", env=env)
    assert "parameters" in done.stdout
    defaults = json.loads((out / "diffserve.json").read_text())
    assert defaults["width"] == defaults["height"] == 128
    assert defaults["spatial_stride"] == 8 and defaults["guidance_scale"] == 5.0
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    # An existing directory is not replaced without --force.
    run_tool("models.py", "--out", str(out), env=env, expect_rc=1)


def test_bench_offline(env, tmp_path):
    out = tmp_path / "offline.json"
    done = run_tool("bench_offline.py", "--model", "tiny-sd", "--batch-sizes", "1,2", "--steps",
                    "1", "--warmup", "0", "--repeats", "1", "--torch-threads", "1",
                    "--output-file", str(out), env=env)
    assert "img/s" in done.stdout
    report = json.loads(out.read_text())
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    assert all(r["images_per_s"] > 0 for r in report["results"])
    assert (report["width"], report["height"], report["num_inference_steps"]) == (64, 64, 1)


def test_bench_serving(env, tmp_path, diffserve_url):
    out = tmp_path / "serving.json"
    done = run_tool("bench_serving.py", "--base-url", diffserve_url, "--num-prompts", "4",
                    "--max-concurrency", "2", "--size", "64x64", "--steps", "1", "--warmup", "1",
                    "--output-file", str(out), env=env)
    assert "Throughput (images/s)" in done.stdout
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["images"]) == (4, 0, 4)
    assert result["images_per_s"] > 0
    assert 0 < result["latency_s"]["p50"] <= result["latency_s"]["p99"]
    metrics = result["server_metrics"]
    assert metrics is not None and 1 <= metrics["mean_batch_size"] <= 2
    assert metrics["images_generated"] == 4
    assert metrics["mean_queue_time_s"] is not None
    # Where the time went: the frontend's latency exceeds queue + execution (validation, IPC,
    # encoding), and the client's exceeds the frontend's (HTTP).
    assert metrics["mean_server_overhead_s"] > 0 and metrics["mean_client_and_http_s"] > 0
    assert "IPC, encoding, rest" in done.stdout

    # Poisson arrivals, random prompts, n=2: still every image back.
    done = run_tool("bench_serving.py", "--base-url", diffserve_url, "--num-prompts", "3",
                    "--request-rate", "50", "--dataset", "random", "--n", "2", "--steps", "1",
                    "--warmup", "0", "--disable-tqdm", "--output-file", str(out), env=env)
    result = json.loads(out.read_text())
    assert (result["completed"], result["images"]) == (3, 6)


def test_bench_serving_reports_unreachable_server(env):
    done = run_tool("bench_serving.py", "--base-url", f"http://127.0.0.1:{free_port()}",
                    "--num-prompts", "2", "--warmup", "1", "--disable-tqdm", "--timeout", "5",
                    env=env, expect_rc=1)
    assert "warm-up" in done.stderr


def test_compare(env, tmp_path):
    out = tmp_path / "compare"
    done = run_tool("compare.py", "--model", "tiny-sd", "--concurrency", "2", "--num-requests",
                    "4", "--warmup", "1", "--max-batch-size", "2", "--steps", "1",
                    "--offline-repeats", "1", "--offline-warmup", "0", "--torch-threads", "1",
                    "--startup-timeout", "120", "--parallel-startup", "--disable-tqdm",
                    "--output-dir", str(out),
                    env=env, timeout=240)
    assert "batching gain offline" in done.stdout
    report = json.loads((out / "compare.json").read_text())
    assert [r["system"] for r in report["runs"]] == ["diffserve-b1", "diffserve", "naive"]
    for run in report["runs"]:
        assert "error" not in run, run.get("error")
        (level,) = run["levels"]
        assert level["concurrency"] == 2
        assert level["completed"] + level["failed"] == 4
        if run["system"] == "naive":
            # It shares tokenizers between threads and may fail a request now and then.
            assert level["completed"] >= 1
        else:
            assert level["failed"] == 0, level["errors"]
    batch_sizes = {r["system"]: r["levels"][0]["server_metrics"] for r in report["runs"]}
    assert batch_sizes["diffserve-b1"]["mean_batch_size"] == 1
    assert 1 <= batch_sizes["diffserve"]["mean_batch_size"] <= 2
    # The executor computes for part of the run, never more than all of it (metrics are read
    # just outside the timed window, hence the slack).
    assert 0 < batch_sizes["diffserve"]["executor_busy_fraction"] <= 1.05
    assert batch_sizes["naive"] is None  # the baseline has no /metrics
    assert [r["batch_size"] for r in report["offline"]["results"]] == [1, 2]
    assert report["summary"]["batching_gain_offline"] > 0
    assert (out / "compare.txt").exists()
    for name in ("diffserve-b1", "diffserve", "naive"):
        assert (out / "logs" / f"{name}.log").exists()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "compare.png").stat().st_size > 0
