"""Micro-benchmark of the scheduler's Batcher alone, with a fake clock and a no-op executor:
scheduling decisions per second, ``stream`` and ``backlog@D`` (target: 20,000/s).

    python benchmarks/bench_batcher.py --mode step --backlog-depth 100,10000
"""

from __future__ import annotations

import random
import sys
import time

from kit import cli
from diffserve.wire.request import ImageRequest
from diffserve.scheduler.batcher import Batcher

SIGNATURES = [(64, 64, 4, 5.0), (64, 64, 8, 5.0), (128, 128, 4, 5.0), (64, 64, 4, 7.5)]


def run(args, depth: int | None, seed: int) -> float:
    """Decisions/s of one run: stream (``depth`` None) or backlog of ``depth``."""
    rng, delay = random.Random(seed), args.delay_ms / 1000
    batcher = Batcher(args.max_batch_size, delay, args.mode)
    sigs = rng.choices(SIGNATURES, [4, 2, 1, 1], k=args.cycles if depth is None else depth)  # a popular default
    todo = [ImageRequest(f"r{i}", "bench", w, h, num_inference_steps=s, guidance_scale=g, prompt=f"prompt {i}",
                         seed=i, n=rng.choices([1, 2, 3, 4], [4, 1, 1, 1])[0]) for i, (w, h, s, g) in enumerate(sigs)]
    gaps = [rng.expovariate(1000.0) for _ in todo]  # 1 ms apart on average
    aborts = [i >= 3 and rng.random() < 0.02 for i in range(len(todo))]
    now = 0.0 if depth is None else delay + 1.0  # a backlog is past its delay
    if depth is not None:
        for r in todo:
            batcher.add(r, 0.0)
    start = time.perf_counter()
    for i in range(args.cycles):
        if depth is None:
            now += gaps[i]
            batcher.add(todo[i], now)
            if aborts[i]:
                batcher.abort(todo[i - 3].request_id)
            while batcher.next_batch(now) is not None:
                pass
        else:
            for piece in batcher.next_batch(now):
                if piece.stop == piece.request.n:
                    batcher.add(piece.request, now)
            now += delay + 1e-3
        batcher.time_until_ready(now)
    return args.cycles / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, max_batch_size=8, repeats=3, output_file=None)
    p.add_argument("--mode", choices=("request", "step"), default="request", help="Signatures of this mode.")
    p.add_argument("--cycles", type=int, default=20_000, help="Decisions per run.")
    p.add_argument("--delay-ms", type=float, default=8.0)
    p.add_argument("--backlog-depth", type=cli.ints, default=[100, 1000, 10000], help="Comma-separated; empty: none.")
    p.add_argument("--target", type=float, default=20_000)
    p.add_argument("--strict", action="store_true", help="Exit 1 if a scenario misses the target.")
    args = p.parse_args(argv)
    results = []
    for depth in [None, *args.backlog_depth]:  # the best of --repeats runs counts
        best = max(run(args, depth, seed) for seed in range(args.repeats))
        results.append({"scenario": "stream" if depth is None else f"backlog@{depth}",
                        "decisions_per_s": best, "meets_target": best >= args.target})
        print(f"{results[-1]['scenario']:<16}{best:>12,.0f} decisions/s {1e6 / best:8.2f} us  "
              f"{'met' if best >= args.target else 'MISSED'} (target {args.target:,.0f})", flush=True)
    cli.write_json(args.output_file, {"config": vars(args), "results": results})
    return 1 if args.strict and not all(r["meets_target"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
