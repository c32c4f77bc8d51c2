"""``--only seed``: the seed benchmark's setup (bench_seed.py) against diffserve over HTTP, with
the real-size random-weight models: Qwen-Image (true CFG: a negative prompt is not sent by the
load, so its default guidance decides), FLUX.1-dev and Z-Image-Turbo at 512x512, 64 prompts,
concurrency 4 and 12, unbounded rate, max batch 1 against 4 and 8 (and each with --offload
layer); step mode against request mode at 512, 768 and 1024; Poisson arrivals at 70% of capacity
with 8 and 24 steps mixed at 512 and 1024. Each family's servers start in turn (a minute or more
each at real size): the slowest section; ``--budget-s`` skips what would not finish."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import bench_seed
from gpu import section


@section("seed", families=("qwen-image", "flux", "z-image"))
def seed(ctx, family: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix="gpu-check-seed-"))
    argv = ["--model", ctx.model(family), "--rounds", "1", "--output-dir", str(out)]
    if ctx.args.tiny:  # the same code in seconds: one concurrency, one batch size, one size
        size = ctx.args.size
        argv += ["--size", size, "--num-requests", "4", "--steps", "2", "--concurrencies", "2",
                 "--max-batch-sizes", "2", "--mode-sizes", size, "--poisson-sizes", size,
                 "--mixed-steps", "1,3", "--torch-threads", "1", "--startup-timeout", "300"]
    else:
        argv += ["--offload-too"]
    try:
        code = bench_seed.main(argv)
        summary = json.loads((out / "seed.json").read_text())["summary"]
        return {**summary["medians"], "targets met": summary["verdicts"], "exit code": code}
    finally:
        shutil.rmtree(out, ignore_errors=True)
