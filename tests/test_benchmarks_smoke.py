"""Smoke runs of the tools in benchmarks/, so that they cannot rot.

Each tool runs as a subprocess with absurdly small settings (a few requests, tiny-sd, one or two
denoising steps, one intra-op thread) and must exit 0 with sane output. These are not
measurements: nothing here checks a speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import background
from background import early

from diffserve.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TOOLS = ["bench_serving.py", "bench_offline.py", "compare.py", "naive_server.py", "bench_batcher.py",
         "queue_model.py", "bench_lora_forward.py", "spike_padded_forward.py", "bench_startup.py"]
TINY = ["--model", "tiny-sd", "--steps", "1", "--num-requests", "4", "--warmup", "1", "--concurrency", "4",
        "--max-batch-size", "4", "--rounds", "1", "--startup-timeout", "120"]


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1")


def run_tool(tool: str, *args: str, env: dict[str, str], timeout: float = 120,
             expect_rc: int = 0) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(BENCH / tool), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == expect_rc, (
        f"{tool} {' '.join(args)} exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n"
        f"--- stderr\n{done.stderr[-3000:]}")
    return done


@pytest.fixture
def diffserve_url(own_server):
    """A diffserve server (tiny-sd, batches of at most 2; the test's ``server`` mark), always
    stopped."""
    server = own_server.start()
    yield server.url
    assert server.stop() == 0, server.log[-3000:]


@pytest.mark.parametrize("tool", TOOLS)
def test_help(tool, env):
    assert "usage:" in run_tool(tool, "--help", env=env, timeout=60).stdout


def test_bench_batcher(env, tmp_path):
    out = tmp_path / "batcher.json"
    done = run_tool("bench_batcher.py", "--cycles", "300", "--repeats", "1", "--backlog-depth", "20,200",
                    "--mode", "step", "--output-file", str(out), env=env)
    assert "decisions/s" in done.stdout
    results = json.loads(out.read_text())["results"]
    assert [r["scenario"] for r in results] == ["stream", "backlog@20", "backlog@200"]
    assert all(r["decisions_per_s"] > 0 for r in results)


@pytest.mark.parametrize("mode", ["step", "request"])
def test_bench_offline(env, tmp_path, mode):
    out = tmp_path / "offline.json"
    done = run_tool("bench_offline.py", "--model", "tiny-sd", "--batching-mode", mode, "--batch-sizes", "1,2",
                    "--steps", "1", "--warmup", "0", "--repeats", "1", "--torch-threads", "1",
                    "--output-file", str(out), env=env)
    assert "img/s" in done.stdout
    report = json.loads(out.read_text())
    assert report["batching_mode"] == mode and report["pipeline_class"] == "StableDiffusionPipeline"
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    assert all(r["images_per_s"] > 0 for r in report["results"])
    assert (report["width"], report["height"], report["num_inference_steps"]) == (64, 64, 1)


@pytest.mark.server("--model", "tiny-sd", "--dynamic-batch-max-size", "2", "--torch-threads", "1",
                    "--log-level", "warning", env={"OMP_NUM_THREADS": "1"})
def test_bench_serving(env, tmp_path, diffserve_url):
    out = tmp_path / "serving.json"
    done = run_tool("bench_serving.py", "--base-url", diffserve_url, "--num-prompts", "4",
                    "--max-concurrency", "2", "--steps", "1", "--warmup", "1", "--output-file", str(out),
                    env=env)
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
                    "--output-file", str(out), env=env)
    result = json.loads(out.read_text())
    assert (result["completed"], result["images"]) == (6, 12)
    assert result["server_metrics"]["images_generated"] == 12
    by_steps = result["latency_by_steps_s"]
    assert set(by_steps) == {"1", "2"} and sum(v["count"] or 0 for v in by_steps.values()) == 6
    assert "1 steps: mean/p50/p99" in done.stdout


def test_bench_startup(env, tmp_path):
    out = tmp_path / "startup.json"
    done = run_tool("bench_startup.py", "--rounds", "1", "--output-file", str(out), env=env)
    medians = json.loads(out.read_text())["medians"]
    assert medians["ready_s"] > 0 and "median" in done.stdout
    assert medians["diffserve::executor-0 cpu_s"] > medians["diffserve::scheduler cpu_s"] > 0
    assert medians["diffserve::frontend cpu_s"] > 0


def test_bench_serving_reports_unreachable_server(env):
    done = run_tool("bench_serving.py", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2",
                    "--warmup", "1", "--timeout", "5", env=env, expect_rc=1)
    assert "warm-up" in done.stderr


# Each compare.py run below, by test: the scenario, then its options.
COMPARES = {
    "test_compare_modes": ("modes", "--torch-threads", "1", "--loads", "50,80", "--mixed-steps",
                           "1,2", "--idle-requests", "2"),
    # --tree: the servers run from that checkout (here this one, by its path: the flag's effect
    # shows in the servers' command environment, and the run must work through it).
    "test_compare_overhead_against_another_checkout": (
        "overhead", "--torch-threads", "1", "--idle-requests", "2", "--tree", str(ROOT)),
    "test_compare_scale": ("scale",),
    "test_compare_baseline": ("baseline", "--torch-threads", "1"),
    "test_compare_lora": ("lora", "--torch-threads", "1", "--lora-counts", "0,2", "--lora-ranks",
                          "4", "--lora-load", "50"),
    "test_compare_sizes_against_an_earlier_checkout": (
        "sizes", "--torch-threads", "1", "--sizes", "64x64,32x32", "--before-tree", str(ROOT),
        "--sizes-load", "50"),
    "test_compare_rollout": ("rollout", "--model", "tiny-flux", "--torch-threads", "1",
                             "--rollout-prompts", "2", "--rollout-n", "3", "--rollout-repeats", "1"),
}
# The servers each scenario starts one after another (executors counted): the longest go first.
SERVER_STARTS = {"scale": 5, "sizes": 3, "baseline": 3, "lora": 2, "rollout": 2, "modes": 2,
                 "overhead": 2}


def _declare_compares() -> None:
    """Each compare.py run above as an early run (tests/background.py): it spends most of its
    time starting servers one after another (one core each), so it runs beside other tests. A
    test takes its own with :func:`compared`."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name, (scenario, *extra) in COMPARES.items():
        def run(scenario=scenario, extra=tuple(extra)):
            out = Path(tempfile.mkdtemp(prefix=f"compare-{scenario}-"))
            return run_compare(scenario, out, *extra, env=env)
        early(f"compare:{name}", weight=SERVER_STARTS[scenario], run=run)


_declare_compares()


def compared(request) -> tuple[dict, Path]:
    """The calling test's compare.py run, checked by :func:`run_compare`: (report, its directory)."""
    return background.result(f"compare:{request.node.originalname}")


def run_compare(scenario: str, out: Path, *extra: str, env: dict[str, str]) -> tuple[dict, Path]:
    done = run_tool("compare.py", scenario, *TINY, *extra, "--output-dir", str(out), env=env, timeout=300)
    assert "| figure | median |" in done.stdout
    report = json.loads((out / f"{scenario}.json").read_text())
    assert (out / f"{scenario}.md").read_text().startswith(f"# {scenario}:")
    (round_,) = report["rounds"]
    assert "error" not in round_["figures"]
    for run in round_["runs"]:
        assert run["completed"] + run["failed"] == run["config"]["num_prompts"]
    return report, out


@pytest.mark.early("compare:test_compare_modes")
def test_compare_modes(request):
    report, out = compared(request)
    medians = report["summary"]["medians"]
    for mode in ("step", "request"):
        assert medians[f"saturated img/s, {mode}"] > 0
        assert medians[f"p99 ms @80%, {mode}"] >= medians[f"p50 ms @80%, {mode}"] > 0
        assert f"idle overhead ms, {mode}" in medians
    assert medians["saturated img/s, step/request"] > 0
    assert set(report["summary"]["verdicts"]) == {t["figure"] for t in report["targets"]}
    labels = [run["label"] for run in report["rounds"][0]["runs"]]
    assert labels[:5] == ["request saturated", "request 50%", "request 80%", "request mixed", "request idle"]
    assert all(run["failed"] == 0 for run in report["rounds"][0]["runs"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "modes.png").stat().st_size > 0


@pytest.mark.early("compare:test_compare_overhead_against_another_checkout")
def test_compare_overhead_against_another_checkout(request):
    report, _ = compared(request)
    medians = report["summary"]["medians"]
    for mode in ("step", "request"):
        assert medians[f"saturated img/s, {mode}"] > 0 and f"idle overhead ms, {mode}" in medians
    assert report["config"]["tree"] == str(ROOT)


@pytest.mark.early("compare:test_compare_scale")
def test_compare_scale(request):
    report, _ = compared(request)
    runs = {run["label"]: run for run in report["rounds"][0]["runs"]}
    assert runs["dp2 x 1 thread"]["server_metrics"]["executors"] == 2
    pair = runs["2 servers x 1 thread, round-robin"]
    assert len(set(pair["base_urls"])) == 2 and pair["server_metrics"]["executors"] == 2
    assert pair["server_metrics"]["images_generated"] == 4
    assert all(run["failed"] == 0 for run in runs.values())
    assert all(v is not None and v > 0 for v in report["summary"]["medians"].values())


@pytest.mark.early("compare:test_compare_baseline")
def test_compare_baseline(request):
    report, _ = compared(request)
    runs = {run["label"]: run for run in report["rounds"][0]["runs"]}
    assert runs["max batch 1"]["server_metrics"]["mean_batch_size"] == 1
    assert runs["naive"]["server_metrics"] is None  # the baseline has no /metrics
    assert runs["naive"]["completed"] >= 1  # it may fail a request now and then (shared tokenizers)
    assert report["summary"]["medians"]["img/s, diffserve/naive"] > 0


@pytest.mark.early("compare:test_compare_lora")
def test_compare_lora(request):
    report, _ = compared(request)
    medians = report["summary"]["medians"]
    assert medians["saturated img/s, 2 adapters, step, rank 4"] > 0
    assert medians["saturated img/s, 2 adapters / none, rank 4"] > 0
    assert medians["p99 ms @50%, 2 adapters, rank 4"] > 0
    runs = {run["label"]: run for run in report["rounds"][0]["runs"]}
    assert runs["step k=2 rank 4 saturated"]["config"]["models"] == ["L0", "L1"]
    assert all(run["failed"] == 0 for run in runs.values())


@pytest.mark.early("compare:test_compare_sizes_against_an_earlier_checkout")
def test_compare_sizes_against_an_earlier_checkout(request):
    report, _ = compared(request)
    medians = report["summary"]["medians"]
    for figure in ("p99 ms size 1 (64x64), step", "p99 ms size 2 (32x32), step before",
                   "p99 ms size 2 (32x32) alone", "p99 ms rare alone", "images per forward, uniform",
                   "saturated img/s mixed, request"):
        assert medians[figure] > 0, figure
    labels = [run["label"] for run in report["rounds"][0]["runs"]]
    assert labels[0] == "request saturated mixed" and "step before mixed @50%" in labels
    assert set(report["summary"]["verdicts"]) == {t["figure"] for t in report["targets"]}


@pytest.mark.early("compare:test_compare_rollout")
def test_compare_rollout(request):
    report, _ = compared(request)
    medians = report["summary"]["medians"]
    for layout in ("groups, step", "singles, step", "groups, request"):
        assert medians[f"samples/s, {layout}"] > 0
        assert medians[f"last sample of a group ms, {layout}"] > 0
    runs = {run["label"]: run for run in report["rounds"][0]["runs"]}
    assert runs["singles, step"]["completed"] == 6 and runs["groups, request"]["failed"] == 0
    assert set(report["summary"]["verdicts"]) == {t["figure"] for t in report["targets"]}
