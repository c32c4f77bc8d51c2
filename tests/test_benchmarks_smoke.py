"""Smoke runs of the tools in benchmarks/, so that they cannot rot.

Each tool runs with absurdly small settings (a few requests, tiny models, one or two denoising
steps, one intra-op thread) and must exit 0 with sane output. These are not measurements: nothing
here checks a speed. Most runs wait on servers that load a model on one core each, so they are
early runs (tests/background.py): they start when collection ends and run beside other tests,
and a test takes its run's output with :func:`ran`. The tools that run torch themselves run in
one interpreter meanwhile (:func:`in_process`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import background
from background import early

from diffserve.launcher import free_port
from helpers import BENCH, ENV, ROOT, run_tool

TINY = ["--model", "tiny-sd", "--steps", "1", "--num-requests", "4", "--warmup", "1", "--concurrency", "4",
        "--max-batch-size", "4", "--rounds", "1", "--startup-timeout", "120", "--torch-threads", "1"]


def check(result: dict, out: Path, name: str) -> dict:
    """A kit.servers.main tool's report (``out``: its --output-dir), checked for what every such report
    holds."""
    assert (out / f"{name}.md").read_text().startswith(f"# {name}:")
    assert json.loads((out / f"{name}.json").read_text()) == result
    (round_,) = result["rounds"]
    assert "error" not in round_["figures"]
    for run in round_["runs"]:
        assert run["completed"] + run["failed"] == run["config"]["num_prompts"]
    return result


def compare(scenario: str, *extra: str):
    def run() -> dict:
        out = Path(tempfile.mkdtemp(prefix=f"bench-{scenario}-"))
        done = run_tool("compare.py", scenario, *TINY, *extra, "--output-dir", str(out), "--output-file",
                        str(out / "report.json"))
        assert "| figure | median |" in done.stdout
        return check(json.loads((out / "report.json").read_text()), out, scenario)
    return run


# The tools that run torch in their own process (the engine, or the plain pipeline that served
# images are checked against), in one interpreter, so that torch imports once: name -> arguments.
IN_PROCESS = {
    **{f"bench_offline {mode}": ("--model", "tiny-sd", "--batching-mode", mode, "--batch-sizes", "1,2",
                                 "--steps", "1", "--warmup", "0", "--repeats", "1", "--torch-threads", "1")
       for mode in ("step", "request")},
    **{f"bench_step {what}": (what, "--model", "tiny-sd", "--batch-sizes", "1,2", "--repeats", "1", "--rounds", "1",
                              "--torch-threads", "1") for what in ("quantization", "cache", "offload")},
    "bench_step compile": ("compile", "--model", "tiny-sd", "--batch-sizes", "1", "--repeats", "1", "--rounds", "1",
                           "--torch-threads", "1"),
    "bench_priorities": ("--model", "tiny-sd", "--rounds", "1", "--interactive-steps", "1", "--batch-steps", "2",
                         "--batch-clients", "1", "--interactive-requests", "3", "--alone-requests", "1",
                         "--max-batch-size", "2", "--torch-threads", "1", "--startup-timeout", "120",
                         "--settle-s", "0.2"),
    "bench_edits": ("--model", "tiny-flux-kontext", "--count", "2", "--rounds", "1", "--steps", "1", "--side", "32",
                    "--torch-threads", "1", "--startup-timeout", "120"),
    "bench_video": ("jobs", "--jobs", "2", "--rounds", "1", "--steps", "2", "--frames", "5", "--torch-threads", "1"),
    "bench_stages gaps": ("gaps", "--models", "tiny-qwen-image,tiny-wan", "--count", "3", "--steps", "3", "--rounds", "1"),
    "bench_stages prompt": ("prompt", "--model", "tiny-sd", "--count", "3", "--steps", "1", "--rounds", "1",
                            "--torch-threads", "1", "--startup-timeout", "120"),
    "bench_stages edits": ("edits", "--edit-model", "tiny-flux-kontext", "--count", "2", "--steps", "1", "--side", "32",
                           "--rounds", "1", "--startup-timeout", "120"),
    "bench_weights apply": ("apply", "--model", "tiny-sd", "--updates", "1", "--rounds", "1", "--torch-threads", "1"),
    "bench_weights rollouts": ("rollouts", "--count", "1", "--runs", "3", "--steps", "2", "--rounds", "1",
                               "--torch-threads", "1"),
}
KIT_MAIN = {"bench_priorities": "priorities", "bench_edits": "edits",  # their --output-dir reports
            **{f"bench_stages {s}": s for s in ("gaps", "prompt", "edits")},
            **{f"bench_weights {s}": s for s in ("apply", "rollouts")}}
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
    runs = {name: [*argv, "--output-file", str(out / f"{name}.json")]
            + (["--output-dir", str(out / name)] if name in KIT_MAIN else []) for name, argv in IN_PROCESS.items()}
    done = subprocess.run([sys.executable, "-c", IN_PROCESS_SCRIPT, str(BENCH), json.dumps(runs)], env=ENV,
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    reports = {name: json.loads((out / f"{name}.json").read_text()) for name in runs}
    for name, scenario in KIT_MAIN.items():
        check(reports[name], out / name, scenario)
    return reports


def startup() -> tuple[dict, str]:
    out = Path(tempfile.mkdtemp(prefix="bench-startup-")) / "startup.json"
    done = run_tool("bench_startup.py", "--rounds", "1", "--output-file", str(out))
    return json.loads(out.read_text()), done.stdout


# Each early run: (about its seconds alone here: the longest start first; the run).
RUNS = {
    "compare scale": (20, compare("scale")),
    "compare baseline": (15, compare("baseline")),
    "compare sizes": (15, compare("sizes", "--sizes", "64x64,32x32", "--sizes-load", "50")),
    "compare rules": (10, compare("rules", "--sizes", "64x64,32x32", "--set-policies", "oldest",
                                 "--guidance-scale", "5")),
    "compare lora": (14, compare("lora", "--lora-counts", "0,2", "--lora-ranks", "4", "--lora-load", "50")),
    "compare rollout": (12, compare("rollout", "--model", "tiny-flux", "--rollout-prompts", "2", "--rollout-n", "3",
                                   "--rollout-repeats", "1")),
    # --tree: the servers run from that checkout (here this one, by its path: the flag's effect
    # shows in the servers' command environment, and the run must work through it).
    "compare modes": (12, compare("modes", "--loads", "50,80", "--mixed-steps", "1,2", "--idle-requests", "2",
                                 "--tree", str(ROOT))),
    "compare cache": (9, compare("cache", "--cache-thresholds", "0.5", "--cache-images", "2")),
    "startup": (4, startup),
}
for _name, (_weight, _run) in RUNS.items():
    early(f"bench:{_name}", weight=_weight, run=_run)


def ran(name: str):
    return background.result(f"bench:{name}")


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
    quantization, cache, compiled = (in_process[f"bench_step {what}"]["results"]
                                     for what in ("quantization", "cache", "compile"))
    assert [r["quantization"] for r in quantization] == ["none", "int8-weight-only"]
    for r in quantization:
        assert 0 < r["denoiser weights MB"] <= r["denoiser weights MB unquantized"]
        assert r["step ms, batch 1"] > 0 and r["step ms, batch 2"] > 0
    assert quantization[1]["denoiser weights MB"] < quantization[0]["denoiser weights MB"]
    assert [r["batch"] for r in cache] == [1, 2] and all(r["ceiling (all hit)"] > 0 for r in cache)
    offload = in_process["bench_step offload"]["results"]
    assert [r["batch"] for r in offload] == [1, 2] and all(r["layer step ms"] > 0 and r["model / none"] > 0
                                                        for r in offload)
    (bucket, counts) = compiled
    assert bucket["batch"] == 1 and bucket["eager step ms"] > 0 and bucket["compiled step ms"] > 0
    assert counts["graphs compiled while measuring"] == 0  # the buckets compiled before the timed steps


def test_bench_priorities(in_process):
    medians = in_process["bench_priorities"]["summary"]["medians"]
    assert medians["capacity req/s"] > 0 and medians["alone s"] > 0
    for policy in ("fcfs", "priority"):
        assert 0 < medians[f"interactive p50 s, {policy}"] <= medians[f"interactive p99 s, {policy}"]
        assert medians[f"batch img/s, {policy}"] > 0 and medians[f"{policy} interactive p99 / alone"] > 0
    assert medians["images checked"] >= 1 and medians["worst pixel diff"] <= 2 and medians["preemptions"] >= 0


def test_bench_edits(in_process):
    medians = in_process["bench_edits"]["summary"]["medians"]
    assert medians["one at a time s"] > 0 and medians["at once s"] > 0
    assert medians["speed-up, at once / one at a time"] > 0 and medians["worst pixel diff"] <= 2


def test_bench_stages(in_process):
    gaps = in_process["bench_stages gaps"]["summary"]["medians"]
    for model in ("tiny-qwen-image", "tiny-wan"):
        for stages in ("on", "off"):
            assert gaps[f"longest gap / median gap, {model}, stages {stages}"] >= 1, (model, stages)
    prompt = in_process["bench_stages prompt"]["summary"]["medians"]
    assert prompt["prompt encodings for one prompt"] == 1 and prompt["prompt cache hits"] == 2
    edits = in_process["bench_stages edits"]["summary"]["medians"]
    assert edits["one at a time / at once, stages on"] > 0 and edits["at once s, stages off"] > 0


def test_bench_video(in_process):
    result = in_process["bench_video"]
    assert result["jobs_per_s"]["concurrent"] > 0 and result["jobs_per_s"]["sequential"] > 0
    assert len(result["rounds"]["concurrent"]) == 1 and result["ratio"] > 0
    assert result["worst_mp4_psnr_db"] > 20 and result["worst_engine_diff"] <= 2


@pytest.mark.early("bench:compare modes")
def test_compare_modes():
    result = ran("compare modes")
    medians = result["summary"]["medians"]
    for mode in ("step", "request"):
        assert medians[f"saturated img/s, {mode}"] > 0
        assert medians[f"p99 ms @80%, {mode}"] >= medians[f"p50 ms @80%, {mode}"] > 0
        assert medians[f"short mean ms (mixed), {mode}"] > 0 and f"idle overhead ms, {mode}" in medians
    assert medians["saturated img/s, step/request"] > 0
    labels = [run["label"] for run in result["rounds"][0]["runs"]]
    assert labels[:5] == ["request saturated", "request 50%", "request 80%", "request mixed", "request idle"]
    assert all(run["failed"] == 0 for run in result["rounds"][0]["runs"])
    assert result["config"]["tree"] == str(ROOT)


@pytest.mark.early("bench:compare scale")
def test_compare_scale():
    result = ran("compare scale")
    runs = {run["label"]: run for run in result["rounds"][0]["runs"]}
    assert runs["dp2 x 1 thread"]["server_metrics"]["executors"] == 2
    pair = runs["2 servers x 1 thread, round-robin"]
    assert len(set(pair["base_urls"])) == 2 and pair["server_metrics"]["executors"] == 2
    assert pair["server_metrics"]["images_generated"] == 4
    assert all(run["failed"] == 0 for run in runs.values())
    assert all(v is not None and v > 0 for v in result["summary"]["medians"].values())


@pytest.mark.early("bench:compare baseline")
def test_compare_baseline():
    result = ran("compare baseline")
    runs = {run["label"]: run for run in result["rounds"][0]["runs"]}
    assert runs["max batch 1"]["server_metrics"]["mean_batch_size"] == 1
    assert runs["naive"]["server_metrics"] is None  # the baseline has no /metrics
    assert runs["naive"]["completed"] >= 1  # it may fail a request now and then (shared tokenizers)
    assert result["summary"]["medians"]["img/s, diffserve/naive"] > 0


@pytest.mark.early("bench:compare lora")
def test_compare_lora():
    result = ran("compare lora")
    medians = result["summary"]["medians"]
    assert medians["saturated img/s, 2 adapters, step, rank 4"] > 0
    assert medians["saturated img/s, 2 adapters / none, rank 4"] > 0
    assert medians["p99 ms @50%, 2 adapters, rank 4"] > 0
    runs = {run["label"]: run for run in result["rounds"][0]["runs"]}
    assert runs["step k=2 rank 4 saturated"]["config"]["models"] == ["L0", "L1"]
    assert all(run["failed"] == 0 for run in runs.values())


@pytest.mark.early("bench:compare sizes")
def test_compare_sizes():
    result = ran("compare sizes")
    medians = result["summary"]["medians"]
    for figure in ("p99 ms size 1 (64x64), step", "p50 ms size 2 (32x32), request", "p99 ms size 2 (32x32) alone",
                   "p99 ms rare alone", "images per forward, uniform", "saturated img/s mixed, request",
                   "saturated img/s mixed, step / request"):
        assert medians[figure] > 0, figure
    labels = [run["label"] for run in result["rounds"][0]["runs"]]
    assert labels[:2] == ["request saturated mixed", "request mixed @50%"] and "step 90/10" in labels


@pytest.mark.early("bench:compare rules")
def test_compare_rules():
    result = ran("compare rules")
    medians = result["summary"]["medians"]
    for figure in ("rate req/s", "p50 ms size 1, request", "p99 ms size 2, oldest", "p50 size 2, oldest / request"):
        assert medians[figure] > 0, figure
    runs = result["rounds"][0]["runs"]
    assert [run["label"] for run in runs] == ["request saturated 64x64", "request mixed", "oldest mixed"]
    assert runs[0]["config"]["sizes"] == ["64x64"] and runs[1]["config"]["sizes"] == ["64x64", "32x32"]
    assert all(run["config"]["extra_body"] == {"guidance_scale": 5.0} for run in runs)


@pytest.mark.early("bench:compare rollout")
def test_compare_rollout():
    result = ran("compare rollout")
    medians = result["summary"]["medians"]
    for layout in ("groups, step", "singles, step", "groups, request"):
        assert medians[f"samples/s, {layout}"] > 0
        assert medians[f"last sample of a group ms, {layout}"] > 0
    runs = {run["label"]: run for run in result["rounds"][0]["runs"]}
    assert runs["singles, step"]["completed"] == 6 and runs["groups, request"]["failed"] == 0


@pytest.mark.early("bench:compare cache")
def test_compare_cache():
    result = ran("compare cache")
    medians = result["summary"]["medians"]
    for threshold in ("0", "0.5"):
        assert medians[f"img/s, threshold {threshold}"] > 0
        assert 0 <= medians[f"rows that hit, threshold {threshold}"] <= 1
    assert medians["rows that hit, threshold 0"] == 0  # threshold 0 never reuses
    assert medians["PSNR min dB, threshold 0.5"] > 20 and medians["img/s, threshold 0.5 / uncached"] > 0
    assert "best img/s / uncached at PSNR >= 30 dB" in medians


@pytest.mark.early("bench:startup")
def test_bench_startup():
    result, stdout = ran("startup")
    medians = result["summary"]["medians"]
    assert medians["ready_s"] > 0 and "| ready_s |" in stdout
    assert medians["diffserve::executor-0 cpu_s"] > medians["diffserve::scheduler cpu_s"] > 0
    assert medians["diffserve::frontend cpu_s"] > 0


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


def test_bench_weights(in_process):
    apply = in_process["bench_weights apply"]["summary"]["medians"]
    assert apply["from disk s"] > 0 and apply["from memory s"] > 0 and apply["wake from level 2 s"] > 0
    rollouts = in_process["bench_weights rollouts"]["summary"]["medians"]
    assert rollouts["img/s steady"] > 0 and rollouts["img/s first after an update / steady"] > 0


def controlnet() -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench-controlnet-"))
    run_tool("bench_controlnet.py", "--count", "4", "--steps", "4", "--rounds", "1", "--torch-threads", "1",
             "--startup-timeout", "120", "--output-dir", str(out), "--output-file", str(out / "report.json"))
    return check(json.loads((out / "report.json").read_text()), out, "controlnet")


early("bench:controlnet", weight=15, run=controlnet)


@pytest.mark.early("bench:controlnet")
def test_bench_controlnet():
    """bench_controlnet.py: 4 requests (each control model, none, a stack of both; 4 steps, so that
    the windows act) at once and one at a time; the images at once equal those made alone."""
    medians = ran("controlnet")["summary"]["medians"]
    assert medians["one at a time s"] > 0 and medians["at once s"] > 0
    assert medians["speed-up, at once / one at a time"] > 0
    # Every image's 4 steps counted, in at least 4 forwards of at most the 4 images.
    assert 1 <= medians["images per forward, at once"] <= 4 and medians["denoiser forwards at once"] >= 4
    assert medians["worst pixel diff"] <= 2
