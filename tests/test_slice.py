"""benchmarks/gpu/slice.sh, a lent device's one command: each configuration one JSON line, on disk
the moment it ends, and none started past what fits in the budget (in process, at once); the
whole rehearsal (``--tiny``) on the CPU, ending by itself inside its budget (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import BENCH, ENV, ROOT

sys.path.insert(0, str(BENCH))
from gpu import Context, judged  # noqa: E402 - benchmarks/ on the path first


def context(tmp_path: Path, budget_s: float) -> Context:
    args = SimpleNamespace(tiny=True, size="64x64", video="32x32x9", budget_s=budget_s,
                           jsonl=str(tmp_path / "gpu-check.jsonl"))
    return Context(args)


def lines(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "gpu-check.jsonl").read_text().splitlines()]


def test_each_configuration_is_a_line_as_it_ends(tmp_path):
    ctx = context(tmp_path, 0)  # no budget
    seen = []

    def second() -> dict:
        seen.append(lines(tmp_path))  # the first one's line is on disk already
        raise RuntimeError("broken build")

    assert ctx.configuration("speed", "flux", "lossless", (150, 40), lambda: {"step ms": 1.0}) == {"step ms": 1.0}
    ctx.configuration("speed", "flux", "fp8", (150, 40), second)
    assert [line["config"] for line in seen[0]] == ["lossless"]
    first, broken = lines(tmp_path)
    assert first == {"section": "speed", "family": "flux", "config": "lossless", "device": "cpu",
                     "s": first["s"], "step ms": 1.0}
    assert broken["config"] == "fp8" and "RuntimeError: broken build" in broken["error"]


def test_a_configuration_that_would_not_fit_is_skipped_and_says_so(tmp_path):
    ctx = context(tmp_path, 30)
    ran = []
    ctx.configuration("rent", "wan", "", (180, 20), lambda: ran.append("fits") or {})  # tiny: 20 s of 30
    ctx.configuration("rent", "flux", "", (180, 40), lambda: ran.append("too long") or {})
    ctx.started -= 29.5  # the budget all but spent: nothing starts
    ctx.configuration("seed", "flux", "", (1, 1), lambda: ran.append("late") or {})
    assert ran == ["fits"]
    fits, long, late = lines(tmp_path)
    assert "skipped" not in fits and long["skipped"].startswith("expects 40 s, ")
    assert late["skipped"] == "expects 1 s, 0 s left of --budget-s"
    assert context(tmp_path, 0).left() == float("inf")


def test_targets_are_judged_where_measured():
    checks = [("x eager, shape 1", ">=", 1.25), ("MFU, shape 1", ">=", 0.55)]
    assert judged({"x eager, shape 1": 1.3, "MFU, shape 1": 0.6}, checks) == {
        "target": "x eager, shape 1 >= 1.25; MFU, shape 1 >= 0.55", "met": True}
    assert judged({"x eager, shape 1": 1.1, "MFU, shape 1": 0.6}, checks)["met"] is False
    assert judged({"x eager, shape 1": 1.3}, checks)["met"] is None  # the MFU not measured (a CPU)


@pytest.mark.slow
def test_slice_tiny_ends_by_itself_inside_its_budget(tmp_path):
    """The whole rehearsal (about 100 s on 2 cores): speed, sizes, rent and seed on the tiny
    models."""
    env = {**ENV, "OUT": str(tmp_path), "PYTHON": sys.executable, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(["bash", str(BENCH / "gpu" / "slice.sh"), "--tiny"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "slice: no wheels installed (--tiny)" in done.stdout
    by = {(line["section"], line.get("family"), line.get("config")): line for line in lines(tmp_path)}
    speed = {config: line for (section, _, config), line in by.items() if section == "speed"}
    assert list(speed) == ["diffusers eager", "lossless", "fp8", "int8", "cuda graphs", "buckets",
                           "diffserve eager", "fp8 weight-only (memory)"]
    assert not any("error" in line for line in by.values()), by
    for name in ("lossless", "int8", "buckets", "diffserve eager"):
        assert speed[name]["step ms, shape 1"] > 0 and speed[name]["x eager, shape 2"] > 0, name
        assert speed[name]["PSNR dB vs eager"] > (20 if name == "int8" else 40), name
    assert speed["lossless"]["target"].startswith("x eager, shape 1 >= 1.25") and speed["lossless"]["met"] is None
    assert speed["int8"]["x lossless, shape 1"] > 0
    assert "needs a CUDA GPU" in speed["fp8"]["skipped"] and speed["cuda graphs"]["skipped"] == "needs CUDA"
    assert "needs a CUDA GPU" in speed["fp8 weight-only (memory)"]["skipped"]
    for family in ("flux", "qwen-image"):  # sizes in one forward, against a set per size
        sizes = by[("sizes", family, "")]
        assert sizes["mixes sizes"] == "" and sizes["aspect mix: apart / mixed"] > 0, sizes
        assert sizes["target"].startswith("512+512: alone / mixed >= 1.19"), sizes
    for family in ("qwen-image", "wan"):
        assert by[("rent", family, "")]["one request"] == "answered"
    assert by[("rent", "flux", "")]["met"] is True  # a wake under 5 s
    for family in ("qwen-image", "flux", "z-image"):
        seed = by[("seed", family, "")]
        assert seed["exit code"] == 0 and seed["img/s, batch 2, c2"] > 0 and "met" in seed, seed
    assert len(by) == 16 and sum(line["s"] for line in by.values()) < 540
