"""The seed benchmark's setup against diffserve over HTTP (sglang PR #18764: one GPU, 512x512, 64
prompts, concurrency 4, request rate unbounded, max batch 4, delay 5 ms, against the same server
with batches of 1), and the load around it:

1. **batching**: servers of max batch 1 and each of ``--max-batch-sizes`` (with ``--offload-too``,
   each again with ``--offload layer``), each loaded at every ``--concurrencies``: images/s, p99,
   and each one's gain over batch 1 at the same concurrency;
2. **modes**: step mode against request mode at each of ``--mode-sizes`` (max batch 4,
   concurrency 4, unbounded rate): images/s, p99;
3. **poisson**: at each of ``--poisson-sizes``, Poisson arrivals at ``--poisson-load`` percent of
   request mode's saturation (its own figure from 2, or measured), each request of
   ``--mixed-steps`` steps: p50 and p99 in each mode.

    python benchmarks/bench_seed.py --model random:qwen-image --size 512x512 --num-requests 64
"""

from __future__ import annotations

import sys

from kit import cli, servers
from kit.servers import Bench, Scenario
from kit.stats import ms, ratio


def batching(b: Bench, f: dict) -> None:
    a = b.args
    for batch in (1, *a.max_batch_sizes):
        for offload in ((None, "layer") if a.offload_too and batch > 1 else (None,)):
            name = f"batch {batch}" + (", offload layer" if offload else "")
            flags = {"--dynamic-batch-max-size": batch, **({"--offload": offload} if offload else {})}
            with b.servers(name, flags) as served:
                for c in a.concurrencies:
                    r = b.load(served, f"{name}, c{c}", max_concurrency=c)
                    f[f"img/s, {name}, c{c}"], f[f"p99 ms, {name}, c{c}"] = r["images_per_s"], ms(r["latency_s"]["p99"])
                    if batch > 1:
                        f[f"img/s gain %, {name} / batch 1, c{c}"] = _gain(f[f"img/s, {name}, c{c}"],
                                                                            f[f"img/s, batch 1, c{c}"])
                        f[f"p99 change %, {name} / batch 1, c{c}"] = _gain(f[f"p99 ms, {name}, c{c}"],
                                                                            f[f"p99 ms, batch 1, c{c}"])


def modes(b: Bench, f: dict) -> None:
    for size in b.args.mode_sizes:
        for mode in ("request", "step"):
            with b.servers(f"{mode} {size}", {"--batching-mode": mode, "--dynamic-batch-max-size": 4}) as served:
                r = b.load(served, f"{mode} {size}", max_concurrency=4, size=size)
            f[f"img/s, {mode}, {size}"], f[f"p99 ms, {mode}, {size}"] = r["images_per_s"], ms(r["latency_s"]["p99"])
            f[f"req/s, {mode}, {size}"] = r["requests_per_s"]
        f[f"img/s gain %, step / request, {size}"] = _gain(f[f"img/s, step, {size}"], f[f"img/s, request, {size}"])


def poisson(b: Bench, f: dict) -> None:
    a = b.args
    for size in a.poisson_sizes:
        rate = None
        for mode in ("request", "step"):  # request first: its saturation sets the rate
            with b.servers(f"{mode} {size} poisson", {"--batching-mode": mode}) as served:
                if rate is None:
                    rate = f.get(f"req/s, request, {size}") or b.load(
                        served, f"request {size} saturated", max_concurrency=a.concurrencies[-1],
                        size=size)["requests_per_s"]
                    # Saturated at the steps of the run; the mix's mean steps change the work a request is.
                    rate *= a.poisson_load / 100 * (a.steps or a.default_steps) / (sum(a.mixed_steps) / len(a.mixed_steps))
                lat = b.load(served, f"{mode} {size} poisson", request_rate=rate, size=size,
                             mixed_steps=a.mixed_steps)["latency_s"]
            f[f"p50 ms, {mode}, {size} poisson"], f[f"p99 ms, {mode}, {size} poisson"] = ms(lat["p50"]), ms(lat["p99"])
        for p in ("p50", "p99"):
            f[f"{p}, step / request, {size} poisson"] = ratio(f[f"{p} ms, step, {size} poisson"],
                                                              f[f"{p} ms, request, {size} poisson"])


def _gain(new: float | None, old: float | None) -> float | None:
    return None if not new or not old else 100.0 * (new / old - 1.0)


def seed(b: Bench) -> dict[str, float | None]:
    f: dict[str, float | None] = {}
    for part in b.args.parts:
        PARTS[part](b, f)
    return f


PARTS = {"batching": batching, "modes": modes, "poisson": poisson}


def arguments(p) -> None:
    p.add_argument("--parts", type=cli.names, default=list(PARTS), help=f"Of {', '.join(PARTS)}.")
    p.add_argument("--concurrencies", type=cli.counts, default=[4, 12], help="batching: closed-loop concurrencies.")
    p.add_argument("--max-batch-sizes", type=cli.counts, default=[4, 8], help="batching: against max batch 1.")
    p.add_argument("--offload-too", action="store_true", help="batching: each batch size with --offload layer too.")
    p.add_argument("--mode-sizes", type=cli.names, default=["512x512", "768x768", "1024x1024"], help="modes: sizes.")
    p.add_argument("--poisson-sizes", type=cli.names, default=["512x512", "1024x1024"], help="poisson: sizes.")
    p.add_argument("--poisson-load", type=float, default=70.0, help="poisson: %% of request mode's saturation.")
    p.add_argument("--mixed-steps", type=cli.counts, default=[8, 24], help="poisson: step counts to mix.")


# The seed's gains on Qwen-Image-2512 (its largest) and sglang's continuous batching (#28690).
TARGETS = [("img/s gain %, batch 4 / batch 1, c4", ">=", 29.6), ("p99 change %, batch 4 / batch 1, c4", "<=", -31.8),
           ("img/s gain %, step / request, 512x512", ">=", 134.0),
           ("img/s gain %, step / request, 768x768", ">=", 22.0),
           ("img/s gain %, step / request, 1024x1024", ">=", 7.3),
           ("p50, step / request, 512x512 poisson", "<=", 0.7), ("p50, step / request, 1024x1024 poisson", "<=", 0.7)]


def main(argv: list[str] | None = None) -> int:
    return servers.main(__doc__, {"seed": Scenario(seed, TARGETS)}, argv, arguments, size="512x512", steps=None,
                        num_requests=64, warmup=2, batch_delay_ms=5.0, torch_threads=0)


if __name__ == "__main__":
    sys.exit(main())
