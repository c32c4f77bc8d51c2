"""Load generator for image servers speaking the OpenAI images API: a closed loop or seeded Poisson
arrivals, round-robin over the ``--base-url``s; throughput, latency (per step count and size where
mixed) and, from the change in diffserve's /metrics summed over the servers, what they did.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 --max-concurrency 16
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from dataclasses import fields

from kit import cli, loadgen


def format_report(r: dict) -> str:
    ms = lambda v: "n/a" if v is None else f"{1000 * v:.1f}"  # noqa: E731
    some = lambda v, keys: " / ".join(ms(v[k]) for k in keys)  # noqa: E731
    lat, sm = r["latency_s"], r["server_metrics"]
    rows = [("Base URLs", ", ".join(r["base_urls"])), ("Request rate (req/s)", r["config"]["request_rate"]),
            ("Max concurrency", r["config"]["max_concurrency"] or "unlimited"),
            ("Duration (s)", f"{r['duration_s']:.2f}"),
            ("Completed / failed", f"{r['completed']} / {r['failed']}"),
            ("Throughput (requests/s)", f"{r['requests_per_s']:.2f}"),
            ("Throughput (images/s)", f"{r['images_per_s']:.2f}"),
            ("Latency mean/p50/p90/p99 (ms)", some(lat, ("mean", "p50", "p90", "p99")))]
    parts = [(f"{k} steps", v) for k, v in r["latency_by_steps_s"].items()] + list(r["latency_by_size_s"].items())
    rows += [(f"  {name}: mean/p50/p99 (ms)", some(v, ("mean", "p50", "p99")) + f" ({v['count'] or 0} requests)")
             for name, v in parts]
    if sm:
        rows += [("Server: mode, executors", f"{sm['batching_mode']}, {sm['executors']:.0f}"),
                 ("Server: dispatches", f"{sm['dispatches']:.0f} (" + ", ".join(
                     f"{reason} {count:.0f}" for reason, count in sm["dispatches_by_reason"].items()) + ")"),
                 ("Server: mean batch / images per step", f"{sm['mean_batch_size'] or 0:.2f} / "
                  f"{sm['mean_step_running_images'] or 0:.2f}"),
                 ("Server: executor busy (%)", f"{100 * (sm['executor_busy_fraction'] or 0):.1f}"),
                 ("Server: mean request latency (ms)", ms(sm["mean_server_latency_s"])),
                 ("  of it queue time (ms)", ms(sm["mean_queue_time_s"])),
                 ("  of it execution (ms)", ms(sm["mean_request_execution_s"])),
                 ("  of it IPC, encoding, rest (ms)", ms(sm["mean_server_overhead_s"])),
                 ("Client and HTTP (ms)", ms(sm["mean_client_and_http_s"]))]
    else:
        rows.append(("Server metrics", "not available (no diffserve /metrics)"))
    rows += [("Error", f"{count} x {message}") for message, count in list(r["errors"].items())[:10]]
    title = f" {r['label'] or 'Serving benchmark'} "
    return "\n".join([title.center(64, "="), *(f"{k + ':':<38}{v}" for k, v in rows), "=" * 64])


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, size=None, steps=None, warmup=2, output_file=None)
    p.add_argument("--base-url", dest="base_urls", metavar="URL", action="append", help="Server address; repeat "
                   "(or comma-separate) for round-robin over several. Default: http://127.0.0.1:8000.")
    p.add_argument("--num-prompts", "--num-requests", type=cli.count, default=200, help="Requests after warm-up.")
    p.add_argument("--max-concurrency", type=cli.count, default=None, help="Most in flight (default: no limit).")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals/s (seeded); inf: at once.")
    p.add_argument("--mixed-steps", type=cli.ints, help="Comma-separated step counts; each request draws one (seeded).")
    p.add_argument("--sizes", type=cli.names, default=None, help='Sizes to mix, e.g. "32x32,48x48": in '
                   "turn, or drawn with --size-weights; latency is reported per size.")
    p.add_argument("--size-weights", type=cli.floats, help='Draw --sizes with these weights (seeded), e.g. "9,1".')
    p.add_argument("--models", type=cli.names, help="`model` of request i: the (i mod count)-th (e.g. LoRA adapters).")
    p.add_argument("--n", type=int, default=1, help="Images per request.")
    p.add_argument("--seed", type=int, default=0, help="Seeds prompts, arrivals, step draws, images.")
    p.add_argument("--output-format", choices=("png", "jpeg", "webp"), default=None)
    p.add_argument("--extra-body", type=json.loads, default={},
                   help='JSON object merged into every body, e.g. \'{"model": "m", "guidance_scale": 3}\'.')
    p.add_argument("--timeout", dest="timeout_s", type=float, default=600.0, help="Per-request timeout, s.")
    p.add_argument("--label", default=None, help="Name of this run in the report and JSON.")
    args = p.parse_args(argv)
    args.base_urls = [u for arg in args.base_urls or ["http://127.0.0.1:8000"] for u in cli.names(arg)]
    try:
        if not isinstance(args.extra_body, dict):
            raise ValueError("--extra-body must be a JSON object")
        load = loadgen.Load(**{f.name: getattr(args, f.name) for f in fields(loadgen.Load) if hasattr(args, f.name)})
        result = asyncio.run(loadgen.run_load(load))
    except (ValueError, RuntimeError, OSError) as error:
        print(f"bench_serving.py: error: {error}", file=sys.stderr)
        return 1
    return cli.done(args, result, format_report(result), code=0 if result["completed"] else 1)


if __name__ == "__main__":
    sys.exit(main())
