"""One denoising step of the step engine, in process: what the accelerators change (``compile``,
``cache``: the step cache's ceiling, ``offload``); each figure the median over ``--rounds`` of a
step's wall time over ``--repeats`` steps, in an engine built as the server builds it.

    python benchmarks/bench_step.py compile --model sd-mid --batch-sizes 1,8
"""

from __future__ import annotations

import os
import sys
import time
from statistics import median

from kit import cli, in_process
from diffserve.processes import bound_openmp_spin


def runtime(args, **config):
    return in_process.runtime(args.model, args.torch_threads, batching_mode="step", skip_startup_check=True, **config)


def step_s(rt, batch: int, tag: str, repeats: int, its: list | None = None, **fields) -> float:
    """A step's seconds at ``batch`` (``fields`` over the requests'; ``its``: these work items,
    of ``repeats`` + 2 steps, instead), the engine built as the server builds it (timing
    deferred: no wait for the device between steps): the wall time of the ``repeats`` steps
    between the first and the last (which decodes), synchronised at their ends alone, as
    diffusers' calls are timed (gpu/speed.py)."""
    ends, steps, cuda = [], iter(range(repeats + 2)), str(rt.loaded.device).startswith("cuda")

    def each(out) -> None:
        if next(steps) in (0, repeats):
            in_process.timed(lambda: None, cuda)  # the device's queued work done
            ends.append(time.perf_counter())

    its = its or in_process.items(rt, batch, tag, repeats + 2, **fields)
    in_process.stepped(rt.step_engine(defer_timing=True), {0: its}, each)
    return (ends[1] - ends[0]) / repeats


def compiled(args, batches: list[int]) -> list[dict]:
    eager = runtime(args)
    warm_up_s, fast = in_process.timed(lambda: runtime(args, compile=True))  # warms the native buckets up
    for batch in batches:  # buckets the warm-up did not reach compile here, untimed
        in_process.run(fast, in_process.items(fast, batch, "warm", 3))
    graphs, by_round = fast.compiled.take_new(), {batch: {"eager": [], "compiled": []} for batch in batches}
    for _ in range(args.rounds):  # the two alternate, so that drift hits both alike
        for name, rt in (("eager", eager), ("compiled", fast)):
            for batch in batches:
                by_round[batch][name].append(step_s(rt, batch, name, args.repeats))
    rows = [{"batch": batch, **{f"{name} step ms": 1000 * median(t[name]) for name in t},
             "speed-up": median(t["eager"]) / median(t["compiled"]), **{f"{name} by round": t[name] for name in t}}
            for batch, t in by_round.items()]
    return rows + [{"start-up with --compile s": warm_up_s, "graphs compiled beyond the start-up's": graphs,
                    "graphs compiled while measuring": fast.compiled.take_new()}]


def ceiling(args, batches: list[int]) -> list[dict]:
    rt, results = runtime(args, step_cache="first-block"), []
    for batch in batches:
        computing, hitting = [], []
        for _ in range(args.rounds):
            computing.append(step_s(rt, batch, "all", args.repeats, cache_threshold=0.0))
            # A threshold no change reaches: every step past the first hits (the last computes).
            hitting.append(step_s(rt, batch, "hit", args.repeats, cache_threshold=1e9))
        c, h = median(computing), median(hitting)
        results.append({"batch": batch, "step ms, every row computes": 1000 * c, "step ms, every row hits": 1000 * h,
                        "ceiling (all hit)": c / h, "by round": {"computes": computing, "hits": hitting}})
    return results


def offloads(args, batches: list[int]) -> list[dict]:
    modes, results = {mode: runtime(args, offload=mode) for mode in ("none", "layer", "model")}, []
    for batch in batches:
        times = {mode: [step_s(rt, batch, mode, args.repeats) for _ in range(args.rounds)]
                 for mode, rt in modes.items()}
        results.append({"batch": batch, **{f"{m} step ms": 1000 * median(t) for m, t in times.items()},
                        **{f"{m} / none": median(t) / median(times["none"]) for m, t in times.items()}})
    return results


WHAT = {"compile": compiled, "cache": ceiling, "offload": offloads}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, model="shapes", batch_sizes=[1, 8], repeats=10, rounds=3, torch_threads=0, output_file=None)
    p.add_argument("what", choices=WHAT)
    args = p.parse_args(argv)
    bound_openmp_spin()  # as the executor does, before torch loads
    import torch

    report = {"what": args.what, "model": args.model, "args": vars(args), "torch_threads": torch.get_num_threads(),
              **cli.machine(), "results": WHAT[args.what](args, args.batch_sizes),
              "load_average_after": os.getloadavg()}
    return cli.done(args, report, report["results"])


if __name__ == "__main__":
    sys.exit(main())
