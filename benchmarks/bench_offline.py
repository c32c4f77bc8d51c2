"""The ceiling: the server's own engine in this process, with no server around it. Per batch size
B, B single-image requests through the engine of ``--batching-mode`` (request: one pipeline call;
step: admitted at once, stepped to the end): the median of ``--repeats`` runs as images/s.

    python benchmarks/bench_offline.py --model tiny-sd --batching-mode step --batch-sizes 1,2,4,8
"""

from __future__ import annotations

import sys

from kit import cli, in_process, stats
from diffserve.config.flags import DEFAULT_MODEL
from diffserve.executor.families.known import UnsupportedMode
from diffserve.processes import bound_openmp_spin


def seconds(rt, mode: str, batch: int, steps: int, seed: int, **fields) -> float:
    """Seconds to ``batch`` requests' images through ``rt``'s engine of ``mode`` (on the host, so
    the device is done with them); ``fields`` over the requests' own (e.g. their size)."""
    taken, outcomes = in_process.timed(
        lambda: in_process.run(rt, in_process.items(rt, batch, "r", steps, seed, **fields), mode))
    failed = [o.error for o in outcomes if o.error]
    if failed or len(outcomes) != batch:
        raise RuntimeError(f"B={batch}: {len(failed)} failed ({failed[:1]}), {len(outcomes)} outcomes")
    return taken


def measure(rt, mode: str, batch: int, steps: int, warmup: int, repeats: int, **fields) -> dict:
    """``batch`` requests at once, ``warmup`` untimed runs first (with the seeds of the timed
    ones), then ``repeats`` timed: their median, as images/s."""
    times = [seconds(rt, mode, batch, steps, 1000 * i, **fields) for i in [*range(warmup), *range(repeats)]][warmup:]
    median = stats.median(times)
    return {"batch_size": batch, "median_s": median, "images_per_s": batch / median, "times_s": times}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, model=DEFAULT_MODEL, batch_sizes=[1, 2, 4, 8], size=None, steps=None, warmup=2,
                   repeats=5, torch_threads=0, output_file=None)
    p.add_argument("--batching-mode", choices=("step", "request"), default="step")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N.")
    args = p.parse_args(argv)
    bound_openmp_spin()  # as the executor does, before torch loads
    import torch

    try:
        rt = in_process.runtime(args.model, args.torch_threads, device=args.device, batching_mode=args.batching_mode)
    except UnsupportedMode as error:
        p.error(str(error))
    loaded, info, mode = rt.loaded, rt.info, args.batching_mode
    width, height = (int(v) for v in args.size.lower().split("x")) if args.size else (info.width, info.height)
    steps, sizes = args.steps or info.default_steps, sorted(set(args.batch_sizes))
    report = {"model": args.model, "pipeline_class": loaded.pipeline_class, "batching_mode": mode,
              "device": loaded.device, "dtype": loaded.dtype, "width": width, "height": height,
              "num_inference_steps": steps, "guidance_scale": info.default_guidance_scale,
              "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__, **cli.machine(),
              "results": []}
    print(f"{args.model} ({loaded.pipeline_class}) on {loaded.device}/{loaded.dtype}, {width}x{height}, "
          f"{steps} steps, {mode} mode, torch threads {torch.get_num_threads()}")
    for batch in sizes:
        row = measure(rt, mode, batch, steps, args.warmup, args.repeats, width=width, height=height)
        report["results"].append(row)
        median, times = row["median_s"], row["times_s"]
        gain = row["images_per_s"] / report["results"][0]["images_per_s"]
        print(f"  B={batch:<4d} {batch / median:8.2f} img/s {gain:6.2f}x B={sizes[0]}  median {1000 * median:.1f} ms "
              f"(min {1000 * min(times):.1f})", flush=True)
    return cli.done(args, report)


if __name__ == "__main__":
    sys.exit(main())
