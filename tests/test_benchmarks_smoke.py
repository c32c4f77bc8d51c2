"""Smoke runs of the tools in benchmarks/ that run torch themselves or drive one server, so that
they cannot rot (the tools that compare servers run early: test_benchmarks_early.py).

Each tool runs with absurdly small settings (a few requests, tiny models, one or two denoising
steps, one intra-op thread) and must exit 0 with sane output. These are not measurements: nothing
here checks a speed. The tools that run torch themselves run in one interpreter
(:func:`in_process`) while the early runs use the rest of the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from diffserve.ports import free_port
from helpers import BENCH, ENV, ROOT, run_tool


# The tools that run torch in their own process (the engine, or the plain pipeline that served
# images are checked against), in one interpreter, so that torch imports once: name -> arguments.
IN_PROCESS = {
    **{f"bench_offline {mode}": ("--model", "tiny-sd", "--batching-mode", mode, "--batch-sizes", "1,2",
                                 "--steps", "1", "--warmup", "0", "--repeats", "1", "--torch-threads", "1")
       for mode in ("step", "request")},
    **{f"bench_step {what}": (what, "--model", "tiny-sd", "--batch-sizes", "1,2", "--repeats", "1", "--rounds", "1",
                              "--torch-threads", "1") for what in ("cache", "offload")},
    "bench_step compile": ("compile", "--model", "tiny-sd", "--batch-sizes", "1", "--repeats", "1", "--rounds", "1",
                           "--torch-threads", "1"),
}
# --compile traced by dynamo's "eager" backend, as the default suite does (inductor's code
# generation alone takes a minute and a half of CPU here); then each tool's main.
IN_PROCESS_SCRIPT = """
import json, sys
from diffserve.executor.accel.compiled import CompiledBlocks
CompiledBlocks.__init__.__defaults__ = ("eager", *CompiledBlocks.__init__.__defaults__[1:])
sys.path.insert(0, sys.argv[1])
for name, argv in json.loads(sys.argv[2]).items():
    print(f"=== {name}", flush=True)
    assert __import__(name.split()[0]).main(argv) == 0, name
"""


@pytest.fixture(scope="module")
def in_process() -> dict[str, dict]:
    """Each tool's JSON report (its --output-file), by the names of :data:`IN_PROCESS`. It runs in
    the test's own thread while the early runs (two at a time) use the rest of the machine."""
    out = Path(tempfile.mkdtemp(prefix="bench-in-process-"))
    runs = {name: [*argv, "--output-file", str(out / f"{name}.json")] for name, argv in IN_PROCESS.items()}
    done = subprocess.run([sys.executable, "-c", IN_PROCESS_SCRIPT, str(BENCH), json.dumps(runs)], env=ENV,
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    return {name: json.loads((out / f"{name}.json").read_text()) for name in runs}


@pytest.fixture
def diffserve_url(own_server):
    """A diffserve server (tiny-sd, batches of at most 2; the test's ``server`` mark), always
    stopped."""
    server = own_server.start()
    yield server.url
    assert server.stop() == 0, server.log[-3000:]


@pytest.mark.server("--model", "tiny-sd", "--dynamic-batch-max-size", "2", "--torch-threads", "1",
                    "--log-level", "warning", env={"OMP_NUM_THREADS": "1"})
def test_bench_serving(tmp_path, diffserve_url):
    out = tmp_path / "serving.json"
    done = run_tool("bench_serving.py", "--base-url", diffserve_url, "--num-prompts", "4",
                    "--max-concurrency", "2", "--steps", "1", "--warmup", "1", "--output-file", str(out))
    assert "Throughput (images/s)" in done.stdout and "IPC, encoding, rest" in done.stdout
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["images"]) == (4, 0, 4)
    assert 0 < result["latency_s"]["p50"] <= result["latency_s"]["p99"]
    metrics = result["server_metrics"]
    assert metrics["images_generated"] == 4 and 1 <= metrics["mean_batch_size"] <= 2
    assert metrics["batching_mode"] == "step" and metrics["executors"] == 1
    assert 0 < metrics["executor_busy_fraction"] <= 1.05
    # The frontend's latency exceeds queue + execution, the client's exceeds the frontend's.
    assert metrics["mean_server_overhead_s"] > 0 and metrics["mean_client_and_http_s"] > 0

    # Poisson arrivals, mixed steps, n=2, the same server named twice (round-robin over two URLs;
    # its metrics are counted once).
    done = run_tool("bench_serving.py", "--base-url", f"{diffserve_url},{diffserve_url}/", "--num-requests",
                    "6", "--request-rate", "50", "--mixed-steps", "1,2", "--n", "2", "--warmup", "0",
                    "--output-file", str(out))
    result = json.loads(out.read_text())
    assert (result["completed"], result["images"]) == (6, 12)
    assert result["server_metrics"]["images_generated"] == 12
    by_steps = result["latency_by_steps_s"]
    assert set(by_steps) == {"1", "2"} and sum(v["count"] or 0 for v in by_steps.values()) == 6
    assert "1 steps: mean/p50/p99" in done.stdout


def test_bench_serving_reports_unreachable_server():
    done = run_tool("bench_serving.py", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2",
                    "--warmup", "1", "--timeout", "5", expect_rc=1)
    assert "warm-up" in done.stderr


def test_bench_batcher(tmp_path):
    out = tmp_path / "batcher.json"
    done = run_tool("bench_batcher.py", "--cycles", "300", "--repeats", "1", "--backlog-depth", "20,200",
                    "--mode", "step", "--output-file", str(out))
    assert "decisions/s" in done.stdout
    results = json.loads(out.read_text())["results"]
    assert [r["scenario"] for r in results] == ["stream", "backlog@20", "backlog@200"]
    assert all(r["decisions_per_s"] > 0 for r in results)


def test_bench_offline(in_process):
    for mode in ("step", "request"):
        report_ = in_process[f"bench_offline {mode}"]
        assert report_["batching_mode"] == mode and report_["pipeline_class"] == "StableDiffusionPipeline"
        assert [r["batch_size"] for r in report_["results"]] == [1, 2]
        assert all(r["images_per_s"] > 0 and len(r["times_s"]) == 1 for r in report_["results"])
        assert (report_["width"], report_["height"], report_["num_inference_steps"]) == (64, 64, 1)


def test_bench_step(in_process):
    cache, compiled = (in_process[f"bench_step {what}"]["results"] for what in ("cache", "compile"))
    assert [r["batch"] for r in cache] == [1, 2] and all(r["ceiling (all hit)"] > 0 for r in cache)
    offload = in_process["bench_step offload"]["results"]
    assert [r["batch"] for r in offload] == [1, 2] and all(r["layer step ms"] > 0 and r["model / none"] > 0
                                                        for r in offload)
    (bucket, counts) = compiled
    assert bucket["batch"] == 1 and bucket["eager step ms"] > 0 and bucket["compiled step ms"] > 0
    assert counts["graphs compiled while measuring"] == 0  # the buckets compiled before the timed steps


def test_bench_parallel_on_two_cpu_ranks(tmp_path):
    """tiny-flux's transformer alone and on two gloo ranks (Ulysses): the same output, and the
    all-to-all bytes and collective calls the tool's model predicts, counted as they ran."""
    out = tmp_path / "parallel.json"
    done = run_tool("bench_parallel.py", "--model", "tiny-flux", "--ranks", "2", "--size", "64x64", "--batch", "2",
                    "--warmup", "1", "--repeats", "1", "--torch-threads", "1", "--output-file", str(out))
    (result,) = json.loads(out.read_text())["rounds"]
    figures = result["figures"]
    assert figures["forward ms, 1 rank"] > 0 and figures["forward ms, 2 ranks"] > 0 and figures["speed-up"] > 0
    assert figures["max abs diff"] < 1e-4
    assert figures["all-to-all bytes/forward"] == figures["all-to-all bytes/forward, modelled"] > 0
    assert figures["all-to-all bytes sent/forward"] == figures["all-to-all bytes/forward"] / 2
    # A double and a single block: q, k, v and the output each, after an exchange of lengths.
    assert result["collectives"]["all_to_all_single"]["calls"] == 8
    assert figures["collective calls/forward"] == figures["collective calls/forward, modelled"] == 18
    assert result["threads"] == {"1 rank": 2, "per rank": 1}
    plans = {(r["model"], r["plan"]): r for r in result["modelled"]}
    flux = plans["FLUX.1-dev 1024²", "Ulysses-8"]
    assert round(flux["TFLOP/step"], 1) == 74.4 and 7 < flux["speed-up"] < 8
    assert plans["Qwen-Image 1024²", "CFG-2"]["speed-up"] > 1.99 and ("FLUX.1-dev 1024²", "CFG-2") not in plans
    assert "| FLUX.1-dev 1024² | Ulysses-2 | 2 |" in done.stdout
