"""Micro-benchmark of the dynamic batcher alone: how many scheduling decisions per second.

Drives :class:`diffserve.scheduler.batcher.Batcher` with a fake clock, requests of mixed batch
signatures (sizes, step counts, guidance scales) and mixed ``n``, and an executor that takes
no time, so only the batcher's own cost is measured. Every request is built before the clock
starts (building one is the frontend's work, not the scheduler's).

Scenarios
- ``stream``: requests arrive one at a time (exponential gaps on the fake clock); after each
  arrival the scheduler takes every ready batch and asks how long until the next one, as the
  scheduler loop does. A few waiting requests are aborted. One decision = one such cycle.
- ``backlog``: a deep queue (``--backlog-depth`` requests) is kept full: each cycle takes one
  batch and puts the requests it finished back at the tail. One decision = one batch taken
  (with its adds). Run at several depths, it shows how the cost grows with the queue.

The target is 20,000 decisions/s; ``--strict`` makes falling short an error (exit 1).

    python benchmarks/bench_batcher.py
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections import deque
from pathlib import Path

from diffserve.protocol import GenerationRequest
from diffserve.scheduler.batcher import Batcher

TARGET = 20_000

# (width, height, steps, guidance): the shared fields that make up a batch signature.
_SIGNATURES = [
    (64, 64, 4, 5.0), (64, 64, 8, 5.0), (128, 128, 4, 5.0), (64, 64, 4, 7.5),
    (128, 64, 4, 5.0), (64, 128, 20, 3.5), (256, 256, 30, 7.0), (96, 96, 4, 5.0),
]


def make_requests(count: int, signatures: int, max_n: int, seed: int,
                  prefix: str = "r") -> list[GenerationRequest]:
    """Mixed requests: signature weighted towards the first ones (a popular default), n mostly 1."""
    rng = random.Random(seed)
    sigs = _SIGNATURES[:signatures]
    weights = [1.0 / (i + 1) for i in range(len(sigs))]
    n_values = list(range(1, max_n + 1))
    n_weights = [4.0] + [1.0] * (max_n - 1)
    requests = []
    for i in range(count):
        width, height, steps, guidance = rng.choices(sigs, weights)[0]
        requests.append(GenerationRequest(
            request_id=f"{prefix}{i}", model="bench", width=width, height=height,
            num_inference_steps=steps, guidance_scale=guidance, prompt=f"prompt {i}",
            negative_prompt="", seed=i, n=rng.choices(n_values, n_weights)[0]))
    return requests


def run_stream(cycles: int, max_batch_size: int, delay_s: float, signatures: int, max_n: int,
               abort_fraction: float, arrival_gap_s: float, seed: int) -> dict:
    requests = make_requests(cycles, signatures, max_n, seed)
    rng = random.Random(seed + 1)
    gaps = [rng.expovariate(1.0 / arrival_gap_s) for _ in range(cycles)]
    # Abort the request that arrived 3 cycles earlier (it may have left already).
    aborts = [i >= 3 and rng.random() < abort_fraction for i in range(cycles)]
    batcher = Batcher(max_batch_size, delay_s)
    now = 0.0
    batches = images = 0
    start = time.perf_counter()
    for i in range(cycles):
        now += gaps[i]
        batcher.add(requests[i], now)
        if aborts[i]:
            batcher.abort(requests[i - 3].request_id)
        while True:
            batch = batcher.next_batch(now)
            if batch is None:
                break
            batches += 1
            for piece in batch:  # the no-op executor
                images += piece.stop - piece.start
        batcher.time_until_ready(now)
    elapsed = time.perf_counter() - start
    return {"scenario": "stream", "decisions": cycles, "seconds": elapsed,
            "decisions_per_s": cycles / elapsed, "us_per_decision": 1e6 * elapsed / cycles,
            "batches": batches, "mean_batch_size": images / batches if batches else None,
            "left_waiting": len(batcher)}


def run_backlog(cycles: int, max_batch_size: int, delay_s: float, signatures: int, max_n: int,
                depth: int, seed: int) -> dict:
    requests = make_requests(depth, signatures, max_n, seed, prefix="b")
    batcher = Batcher(max_batch_size, delay_s)
    now = 0.0
    for request in requests:
        batcher.add(request, now)
    now = delay_s + 1.0  # every waiting request is past its delay: each call yields a batch
    batches = images = adds = 0
    refill: deque = deque()
    start = time.perf_counter()
    for _ in range(cycles):
        batch = batcher.next_batch(now)
        batches += 1
        for piece in batch:
            images += piece.stop - piece.start
            if piece.stop == piece.request.n:
                refill.append(piece.request)
        while refill:
            batcher.add(refill.popleft(), now)
            adds += 1
        batcher.time_until_ready(now)
        now += delay_s + 1e-3  # the executor's turn: the next head is past its delay too
    elapsed = time.perf_counter() - start
    return {"scenario": "backlog", "decisions": cycles, "seconds": elapsed,
            "decisions_per_s": cycles / elapsed, "us_per_decision": 1e6 * elapsed / cycles,
            "batches": batches, "mean_batch_size": images / batches, "adds": adds,
            "queue_depth": depth, "left_waiting": len(batcher)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Decisions/s of diffserve's dynamic batcher alone (fake clock, mixed "
                    f"signatures, no-op executor). Target: {TARGET:,} decisions/s.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--cycles", type=int, default=20_000, help="Decisions per scenario.")
    parser.add_argument("--scenarios", default="stream,backlog", help="Comma-separated: stream, backlog.")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--delay-ms", type=float, default=8.0, help="Batcher max delay.")
    parser.add_argument("--signatures", type=int, default=4,
                        help=f"Distinct batch signatures, 1..{len(_SIGNATURES)}.")
    parser.add_argument("--max-n", type=int, default=4, help="Largest n per request.")
    parser.add_argument("--arrival-gap-ms", type=float, default=1.0,
                        help="Mean fake-clock gap between arrivals (stream).")
    parser.add_argument("--abort-fraction", type=float, default=0.02,
                        help="Share of cycles that abort an earlier request (stream).")
    parser.add_argument("--backlog-depth", default="100,1000,10000",
                        help="Requests kept waiting (backlog); a comma-separated list runs the "
                             "scenario once per depth.")
    parser.add_argument("--repeats", type=int, default=3, help="Runs per scenario; the best counts.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=TARGET, help="Decisions/s to meet.")
    parser.add_argument("--strict", action="store_true", help="Exit 1 if a scenario misses the target.")
    parser.add_argument("--output-file", default=None, help="Write the results as JSON here.")
    args = parser.parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(scenarios) - {"stream", "backlog"}
    if unknown or not scenarios:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown)) or '(none given)'}")
    if not 1 <= args.signatures <= len(_SIGNATURES):
        parser.error(f"--signatures must be between 1 and {len(_SIGNATURES)}")
    try:
        depths = [int(d) for d in args.backlog_depth.split(",") if d.strip()]
    except ValueError:
        parser.error(f"--backlog-depth {args.backlog_depth!r} is not a list of integers")
    if args.cycles < 1 or args.repeats < 1 or args.max_n < 1 or not depths or min(depths) < 1:
        parser.error("--cycles, --repeats, --max-n and --backlog-depth must be >= 1")

    runs_to_do = [("stream", None)] if "stream" in scenarios else []
    runs_to_do += [("backlog", d) for d in depths] if "backlog" in scenarios else []
    results = []
    for scenario, depth in runs_to_do:
        runs = []
        for repeat in range(args.repeats):
            if scenario == "stream":
                runs.append(run_stream(args.cycles, args.max_batch_size, args.delay_ms / 1000,
                                       args.signatures, args.max_n, args.abort_fraction,
                                       args.arrival_gap_ms / 1000, args.seed + repeat))
            else:
                runs.append(run_backlog(args.cycles, args.max_batch_size, args.delay_ms / 1000,
                                        args.signatures, args.max_n, depth, args.seed + repeat))
        best = max(runs, key=lambda r: r["decisions_per_s"])
        best["all_decisions_per_s"] = [r["decisions_per_s"] for r in runs]
        best["meets_target"] = best["decisions_per_s"] >= args.target
        results.append(best)

    print(f"Batcher(max_batch_size={args.max_batch_size}, max_delay={args.delay_ms:g} ms), "
          f"{args.signatures} signatures, n <= {args.max_n}, {args.cycles:,} decisions, "
          f"best of {args.repeats}")
    print(f"{'scenario':<16}{'decisions/s':>14}{'us/decision':>13}{'batches':>10}"
          f"{'mean batch':>12}  target {args.target:,.0f}/s")
    for r in results:
        mean = "n/a" if r["mean_batch_size"] is None else f"{r['mean_batch_size']:.2f}"
        name = r["scenario"] + (f"@{r['queue_depth']}" if "queue_depth" in r else "")
        print(f"{name:<16}{r['decisions_per_s']:>14,.0f}{r['us_per_decision']:>13.2f}"
              f"{r['batches']:>10,}{mean:>12}  {'met' if r['meets_target'] else 'NOT MET'}")
    if args.output_file:
        out = Path(args.output_file)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"target": args.target, "config": vars(args),
                                   "python": platform.python_version(),
                                   "results": results}, indent=2) + "\n")
    if args.strict and not all(r["meets_target"] for r in results):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
