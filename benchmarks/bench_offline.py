"""The ceiling: the model's own throughput with no server around it.

Loads the same diffusers pipeline a server would (an embedded model name such as ``tiny-sd``,
a local pipeline directory, or a hub id) in this process, with the serving defaults from the
model's ``diffserve.json``, and times one pipeline call per batch size B on the thread that
loaded it: warm-up calls first, then ``--repeats`` timed calls, and reports the median as
images/s. A serving system cannot beat B = its largest batch; with batching disabled it
cannot beat B = 1.

    python benchmarks/bench_offline.py --model tiny-sd --batch-sizes 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from diffserve.config import DEFAULT_MODEL  # noqa: E402

HERE = Path(__file__).resolve().parent
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


def _prompts(count: int) -> list[str]:
    lines = [line.strip() for line in (HERE / "prompts.txt").read_text(encoding="utf-8").splitlines()]
    pool = [line for line in lines if line and not line.startswith("#")] or ["a photo of a cat"]
    return [pool[i % len(pool)] for i in range(count)]


def parse_batch_sizes(text: str) -> list[int]:
    sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--batch-sizes {text!r}: expected positive integers, e.g. 1,2,4,8")
    return sizes


def load_pipeline(model: str, device: str, dtype: str, torch_threads: int):
    """(pipeline, serving defaults, device, dtype name), loaded on this thread."""
    import diffusers
    import torch
    import transformers
    from diffusers import DiffusionPipeline

    from diffserve.models.registry import resolve_model, serving_defaults

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()

    torch.set_num_threads(torch_threads or os.cpu_count() or 1)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "float16" if device.startswith("cuda") else "float32"
    path = resolve_model(model)
    pipe = DiffusionPipeline.from_pretrained(path, dtype=getattr(torch, dtype))
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe, serving_defaults(path), device, dtype


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Offline ceiling: images/s of one in-process pipeline call per batch size.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="Embedded model name, pipeline directory or hub id.")
    parser.add_argument("--batch-sizes", default="1,2,4,8", help="Comma-separated batch sizes.")
    parser.add_argument("--size", default=None,
                        help='"WIDTHxHEIGHT" (default: from diffserve.json, else 512x512).')
    parser.add_argument("--steps", type=int, default=None,
                        help="num_inference_steps (default: from diffserve.json, else 30).")
    parser.add_argument("--guidance-scale", type=float, default=None,
                        help="guidance_scale (default: from diffserve.json, else the pipeline's).")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed calls per batch size.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed calls per batch size.")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N.")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch intra-op threads; 0 = all cores (as diffserve does).")
    parser.add_argument("--output-file", default=None, help="Write the results as JSON here.")
    args = parser.parse_args(argv)
    try:
        batch_sizes = parse_batch_sizes(args.batch_sizes)
    except ValueError as error:
        parser.error(str(error))
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")

    import torch

    pipe, defaults, device, dtype = load_pipeline(args.model, args.device, args.dtype,
                                                  args.torch_threads)
    if args.size:
        width, height = (int(v) for v in args.size.lower().split("x"))
    else:
        width, height = int(defaults.get("width", 512)), int(defaults.get("height", 512))
    steps = args.steps or int(defaults.get("num_inference_steps", 30))
    guidance = args.guidance_scale if args.guidance_scale is not None else defaults.get("guidance_scale")
    extra = dict(defaults.get("pipeline_kwargs", {}))
    if guidance is not None:
        extra["guidance_scale"] = float(guidance)

    def call(batch: int, seed: int) -> None:
        generators = [torch.Generator("cpu").manual_seed(seed + i) for i in range(batch)]
        # Under inference_mode, as the server's runner makes the call: both time the same thing.
        with torch.inference_mode():
            pipe(prompt=_prompts(batch), generator=generators, num_inference_steps=steps,
                 height=height, width=width, output_type="np", **extra)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    print(f"model {args.model} ({type(pipe).__name__}) on {device}/{dtype}, {width}x{height}, "
          f"{steps} steps, guidance {guidance}, torch threads {torch.get_num_threads()}")
    results = []
    for batch in batch_sizes:
        for i in range(args.warmup):
            call(batch, 1000 * i)
        times = []
        for i in range(args.repeats):
            start = time.perf_counter()
            call(batch, 1000 * i)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        results.append({"batch_size": batch, "median_s": median, "min_s": min(times),
                        "images_per_s": batch / median, "ms_per_image": 1000 * median / batch,
                        "times_s": times})
        print(f"  B={batch:<4d} {batch / median:8.2f} img/s   median {1000 * median:8.1f} ms/call "
              f"({1000 * median / batch:.1f} ms/image, min {1000 * min(times):.1f} ms)", flush=True)

    base = results[0]["images_per_s"]
    print(f"{'B':>6} {'img/s':>9} {'vs B=' + str(results[0]['batch_size']):>9}")
    for r in results:
        print(f"{r['batch_size']:>6} {r['images_per_s']:>9.2f} {r['images_per_s'] / base:>8.2f}x")
    report = {
        "model": args.model, "pipeline_class": type(pipe).__name__, "device": device,
        "dtype": dtype, "width": width, "height": height, "num_inference_steps": steps,
        "guidance_scale": guidance, "warmup": args.warmup, "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine(),
                    "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None},
        "results": results,
    }
    if args.output_file:
        out = Path(args.output_file)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
