"""The ceiling: the server's own engine in this process, with no server around it.

Loads the model as an executor does and, per batch size B, times B single-image requests through
the engine of ``--batching-mode`` (request: one pipeline call; step: admitted at once, stepped to
the end): the median of ``--repeats`` runs as images/s. A server cannot beat B = its largest batch.

    python benchmarks/bench_offline.py --model tiny-sd --batching-mode step --batch-sizes 1,2,4,8
"""

from __future__ import annotations

import statistics
import sys
import time

import kit
from diffserve.config import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    p = kit.parser(__doc__, model=DEFAULT_MODEL, batch_sizes=[1, 2, 4, 8], size=None, steps=None, warmup=2,
                   repeats=5, torch_threads=0, output_file=None)
    p.add_argument("--batching-mode", choices=("step", "request"), default="step")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N.")
    args = p.parse_args(argv)
    sizes = sorted(set(args.batch_sizes))
    if not sizes or sizes[0] < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--batch-sizes needs positive integers, --repeats >= 1, --warmup >= 0")
    from diffserve.executor.process_setup import bound_openmp_spin

    bound_openmp_spin()  # as the executor does, before torch loads
    import torch

    from diffserve.config import ServerConfig
    from diffserve.executor.loading import UnsupportedMode
    from diffserve.executor.runtime import build_runtime
    from diffserve.protocol import ImageRequest, Work, WorkItem

    try:
        rt = build_runtime(ServerConfig(model=args.model, device=args.device, batching_mode=args.batching_mode),
                           torch_threads=args.torch_threads)
    except UnsupportedMode as error:
        p.error(str(error))
    loaded, info, prompts, runner = rt.loaded, rt.info, kit.prompts(), rt.request_runner()
    width, height = (int(v) for v in args.size.lower().split("x")) if args.size else (info.width, info.height)
    steps = args.steps or info.default_steps

    def run(batch: int, seed: int) -> None:
        items = [WorkItem(ImageRequest(f"r{seed}-{i}", args.model, width, height, num_inference_steps=steps,
                                       guidance_scale=info.default_guidance_scale, prompt=prompts[i % len(prompts)],
                                       seed=seed + i), 0, 1) for i in range(batch)]
        if args.batching_mode == "request":
            outcomes = runner.execute(Work(seed, items), [[] for _ in items])
        else:
            engine = rt.step_engine()
            outcomes = engine.admit(items, [[] for _ in items])
            while engine:
                outcomes += engine.step().finished
        if loaded.device.startswith("cuda"):
            torch.cuda.synchronize()
        failed = [o.error for o in outcomes if o.error]
        if failed or len(outcomes) != batch:
            raise RuntimeError(f"B={batch}: {len(failed)} failed ({failed[:1]}), {len(outcomes)} outcomes")

    report = {"model": args.model, "pipeline_class": loaded.pipeline_class, "batching_mode": args.batching_mode,
              "device": loaded.device, "dtype": loaded.dtype, "width": width, "height": height,
              "num_inference_steps": steps, "guidance_scale": info.default_guidance_scale,
              "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__, **kit.machine(),
              "results": []}
    print(f"{args.model} ({loaded.pipeline_class}) on {loaded.device}/{loaded.dtype}, {width}x{height}, "
          f"{steps} steps, {args.batching_mode} mode, torch threads {torch.get_num_threads()}")
    for batch in sizes:
        for i in range(args.warmup):
            run(batch, 1000 * i)
        times = []
        for i in range(args.repeats):
            start = time.perf_counter()
            run(batch, 1000 * i)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        report["results"].append({"batch_size": batch, "median_s": median, "images_per_s": batch / median,
                                  "times_s": times})
        gain = batch / median / report["results"][0]["images_per_s"]
        print(f"  B={batch:<4d} {batch / median:8.2f} img/s {gain:6.2f}x B={sizes[0]}  median {1000 * median:.1f} ms "
              f"(min {1000 * min(times):.1f})", flush=True)
    kit.write_json(args.output_file, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
