"""Smoke runs of gpu_check.py's sections on the CPU: the code a lent GPU runs, at the released
architectures' tiny scale, so that it cannot rot before a GPU comes. Nothing here checks a speed."""

from __future__ import annotations

import json

import pytest

from helpers import run_tool


def test_gpu_check_tiny_runs_every_section(tmp_path):
    """gpu_check --tiny: every section's code on the released architectures at their tiny scale
    (random:NAME:tiny), built in memory as the published sizes are; what needs CUDA or two GPUs
    says so."""
    out = tmp_path / "gpu-check.json"
    only = ["rent", "first-day", "exactness", "throughput", "stages", "weights", "memory",
            "parallel"]  # speed and seed: tests of their own
    done = run_tool("gpu_check.py", "--tiny", "--torch-threads", "1", "--output-file", str(out),
                    "--only", ",".join(only), "--families", "flux,qwen-image,wan")
    report = json.loads(out.read_text())
    assert report["models"] == {"flux": "random:flux.1-dev:tiny", "qwen-image": "random:qwen-image:tiny",
                                "wan": "random:wan2.1-14b:tiny"}
    sections = report["sections"]
    assert list(sections) == only
    rent = sections["rent"]["families"]
    for family in ("qwen-image", "wan"):  # on a CPU: no cap, the rest as on a GPU
        assert rent[family]["mode"] == "step" and rent[family]["one request"] == "answered", rent[family]
        assert rent[family]["float32 reference on"] == "device"  # the host is the device here
    assert rent["flux"]["largest pixel difference after the wake"] == 0
    assert rent["flux"]["text encoder on"] == "cpu"
    assert sections["memory"] == {"status": "skipped: needs CUDA"}
    assert sections["parallel"] == {"status": "skipped: needs 2+ GPUs"}
    first, exact = sections["first-day"]["families"], sections["exactness"]["families"]
    assert set(first) == set(exact) == {"flux", "qwen-image", "wan"}
    for family, fig in first.items():
        assert fig["mode"] == "step" and fig["fallback"] == {} and fig["task modes"]["generate"] == "step", family
        assert fig["non-finite"] == 0 and fig["failed"] == [] and "start-up check" not in fig, family
        assert 0 < fig["denoiser ms, perf_counter alone"] and 0 < fig["step ms, synced"], family
        assert fig["out-of-memory split"] == ("images only" if family == "wan" else "skipped: needs CUDA")
        assert exact[family]["dtype"] == "bfloat16" and exact[family]["worst PSNR dB"] > 30, family
    for fig in sections["throughput"]["families"].values():
        assert fig["img/s, request"] > 0 and fig["img/s, step"] > 0
    assert set(sections["throughput"]["families"]) == {"flux", "qwen-image"}
    for fig in sections["stages"]["families"].values():
        assert fig["img/s, stages on"] > 0 and fig["p99 s, stages off"] > 0
        assert fig["longest gap / median gap, stages on"] >= 1 and fig["longest gap / median gap, stages off"] >= 1
    for fig in sections["weights"]["families"].values():
        assert fig["update from disk s"] > 0 and fig["update from shared memory s"] > 0 and fig["wake s"] >= 0
    assert "memory: skipped: needs CUDA" in done.stdout and "| flux | float32 |" in done.stdout


@pytest.mark.slow
def test_gpu_check_speed_tiny(tmp_path):
    """gpu_check --only speed --tiny: eager diffusers against each configuration of diffserve; fp8
    is refused on a CPU, and says so, while the rest runs. Slow: a compile run (inductor's code
    generation on the CPU); each configuration's own code is in the default suite (--attention-backend
    auto: tests/executor/test_attention.py, --compile: test_compiled.py, fp8 refused:
    test_quantization.py)."""
    out = tmp_path / "gpu-check.json"
    run_tool("gpu_check.py", "--tiny", "--torch-threads", "1", "--output-file", str(out),
             "--only", "speed", "--families", "flux", "--repeats", "1")
    fig = json.loads(out.read_text())["sections"]["speed"]["families"]["flux"]
    assert "error" not in fig, fig
    for name in ("diffserve", "attention auto", "compile"):
        assert fig[f"{name}: step ms, batch 2"] > 0 and fig[f"{name}: x eager, batch 2"] > 0, name
        assert fig[f"{name}: PSNR dB vs eager"] > 40, name
    assert fig["diffusers eager: step ms, batch 1"] > 0
    assert "needs a CUDA GPU" in fig["fp8: refused"] and "needs a CUDA GPU" in fig["all: refused"]
    assert "needs a CUDA GPU" in fig["fp8 weight-only: refused"] and fig["compile: start s"] > 0


@pytest.mark.slow
def test_gpu_check_seed_tiny(tmp_path):
    """gpu_check --only seed --tiny: bench_seed.py's parts against real servers, in seconds."""
    out = tmp_path / "gpu-check.json"
    run_tool("gpu_check.py", "--tiny", "--torch-threads", "1", "--output-file", str(out),
             "--only", "seed", "--families", "flux", timeout=900)
    fig = json.loads(out.read_text())["sections"]["seed"]["families"]["flux"]
    assert "error" not in fig and fig["exit code"] == 0, fig
    assert fig["img/s, batch 2, c2"] > 0 and fig["img/s, step, 64x64"] > 0
    assert fig["p50 ms, step, 64x64 poisson"] > 0
