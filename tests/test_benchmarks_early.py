"""Smoke runs of the tools in benchmarks/ that start servers and compare them, so that they
cannot rot.

Each tool runs with absurdly small settings (a few requests, tiny models, one or two denoising
steps, one intra-op thread) and must exit 0 with sane output; nothing here checks a speed. They
wait on servers that load a model on one core each, so they are early runs (tests/background.py):
they start when collection ends and run beside other tests, and a test takes its run's output
with :func:`ran`.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

import background
from background import early

from helpers import ROOT, check_report, run_tool

TINY = ["--model", "tiny-sd", "--steps", "1", "--num-requests", "4", "--warmup", "1", "--concurrency", "4",
        "--max-batch-size", "4", "--rounds", "1", "--startup-timeout", "120", "--torch-threads", "1"]


def compare(scenario: str, *extra: str):
    def run() -> dict:
        out = Path(tempfile.mkdtemp(prefix=f"bench-{scenario}-"))
        done = run_tool("compare.py", scenario, *TINY, *extra, "--output-dir", str(out), "--output-file",
                        str(out / "report.json"))
        assert "| figure | median |" in done.stdout
        return check_report(json.loads((out / "report.json").read_text()), out, scenario)
    return run


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
    "compare models": (14, compare("models", "--second-model", "tiny-sd", "--swap-wait-ms", "0")),
}
for _name, (_weight, _run) in RUNS.items():
    early(f"bench:{_name}", weight=_weight, run=_run)


def ran(name: str):
    return background.result(f"bench:{name}")


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


@pytest.mark.early("bench:compare models")
def test_compare_models():
    result = ran("compare models")
    medians = result["summary"]["medians"]
    for name in ("one server, both resident", "one server, one resident", "two servers"):
        assert medians[f"img/s, {name}"] > 0
    for run in result["rounds"][0]["runs"]:
        assert run["failed"] == 0, run["label"]
    assert medians["swaps in"] >= 1 and medians["mean swap in ms"] > 0  # the one-resident server swapped
