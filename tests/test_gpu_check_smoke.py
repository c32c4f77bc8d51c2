"""Smoke runs of gpu_check.py's sections on the CPU: the code a lent GPU runs, at the released
architectures' tiny scale, so that it cannot rot before a GPU comes. Nothing here checks a speed."""

from __future__ import annotations

import json

from helpers import run_tool


def test_gpu_check_tiny_runs_every_section(tmp_path):
    """gpu_check --tiny: every section's code on the released architectures at their tiny scale
    (random:NAME:tiny), built in memory as the published sizes are; what needs CUDA or two GPUs
    says so."""
    out = tmp_path / "gpu-check.json"
    only = ["rent", "first-day", "exactness", "memory", "parallel"]  # speed and seed: test_slice.py
    done = run_tool("gpu_check.py", "--tiny", "--torch-threads", "1", "--output-file", str(out),
                    "--only", ",".join(only), "--families", "flux,qwen-image,wan,flux-fill")
    report = json.loads(out.read_text())
    assert report["models"] == {"flux": "random:flux.1-dev:tiny", "qwen-image": "random:qwen-image:tiny",
                                "wan": "random:wan2.1-14b:tiny", "flux-fill": "random:flux.1-fill-dev:tiny"}
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
    assert set(first) == {"flux", "qwen-image", "wan"} and set(exact) == {*first, "flux-fill"}
    # FLUX.1 Fill: two inpaintings and two outpaintings against FluxFillPipeline, in one forward
    assert exact["flux-fill"]["failed"] == [] and exact["flux-fill"]["most rows a forward"] == 4
    assert exact["flux-fill"]["worst PSNR dB"] > 30
    for family, fig in first.items():
        assert fig["mode"] == "step" and fig["fallback"] == {} and fig["task modes"]["generate"] == "step", family
        assert fig["non-finite"] == 0 and fig["failed"] == [] and "start-up check" not in fig, family
        assert 0 < fig["denoiser ms, perf_counter alone"] and 0 < fig["step ms, synced"], family
        assert fig["out-of-memory split"] == ("images only" if family == "wan" else "skipped: needs CUDA")
        assert exact[family]["dtype"] == "bfloat16" and exact[family]["worst PSNR dB"] > 30, family
    assert rent["flux"]["wake s"] >= 0 and rent["flux"]["target"] == "wake s <= 5"
    assert "memory: skipped: needs CUDA" in done.stdout and "| flux | float32 |" in done.stdout
