"""``--only seed``: the seed benchmark's setup (bench_seed.py's batching part) over HTTP, the real-size
random-weight Qwen-Image (true CFG: its default guidance), FLUX.1-dev and Z-Image-Turbo: 512x512, 64
prompts, concurrency 4, max batch 4 (step mode) against 1, judged by the seed's gains."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import bench_seed
from gpu import judged, section


@section("seed", families=("qwen-image", "flux", "z-image"), cost=(240, 60))
def seed(ctx, family: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix="gpu-check-seed-"))
    argv = ["--model", ctx.model(family), "--rounds", "1", "--output-dir", str(out), "--parts", "batching"]
    if ctx.args.tiny:  # the same code in seconds
        argv += ["--size", ctx.args.size, "--num-requests", "4", "--steps", "2", "--concurrencies", "2",
                 "--max-batch-sizes", "2", "--torch-threads", "1", "--startup-timeout", "300"]
    else:
        argv += ["--concurrencies", "4", "--max-batch-sizes", "4"]
    try:
        code = bench_seed.main(argv)
        summary = json.loads((out / "seed.json").read_text())["summary"]
        return {**summary["medians"], "exit code": code, **judged(summary["medians"], bench_seed.TARGETS[:2])}
    finally:
        shutil.rmtree(out, ignore_errors=True)
