"""Compare diffserve with and without batching, a naive baseline server, and the offline ceiling.

In one run, on the same model and the same load (same prompts, same seeds):

1. the offline ceiling: bench_offline.py, one in-process pipeline call per batch size;
2. ``diffserve-b1``: diffserve with ``--dynamic-batch-max-size 1`` (no batching);
3. ``diffserve``: diffserve with batching (``--max-batch-size``, ``--batch-delay-ms``);
4. ``naive``: the baseline in naive_server.py (one pipeline call per request in a thread pool).

Each server is started alone, measured at every concurrency level with bench_serving (a closed
loop: ``--num-requests`` requests, at most ``concurrency`` in flight), then stopped. Prints a
table, and writes ``compare.json``, ``compare.png`` and the servers' logs to ``--output-dir``.

With ``--rounds R`` all of that is repeated R times (fresh processes each round, the order of the
servers rotated), and the table gives medians. On a small or shared machine the speed of the same
pipeline drifts by tens of percent between processes and minutes, so a ratio is taken within
each round, where the offline run and the servers are minutes apart, and its median reported.

    python benchmarks/compare.py --model tiny-sd --concurrency 1,4,16 --num-requests 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from diffserve.config import DEFAULT_MODEL  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serving import BenchConfig, run_benchmark  # noqa: E402
from compare_report import combine_summaries, format_tables, merge_rounds, plot, summarize  # noqa: E402
from launch import Server, ServerError, child_env, diffserve_command, free_port, naive_command  # noqa: E402

SYSTEMS = ("diffserve-b1", "diffserve", "naive")


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"compare.py: error: {flag} {text!r} is not a comma-separated list of integers")
    if not values or min(values) < 1:
        raise SystemExit(f"compare.py: error: {flag} needs positive integers")
    return sorted(set(values))


def default_offline_sizes(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def machine_description() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def run_offline(args, model: str, out_dir: Path) -> dict | None:
    out = out_dir / "offline.json"
    cmd = [sys.executable, str(HERE / "bench_offline.py"), "--model", model,
           "--batch-sizes", ",".join(map(str, args.offline_batch_sizes)),
           "--repeats", str(args.offline_repeats), "--warmup", str(args.offline_warmup),
           "--output-file", str(out)]
    if args.size:
        cmd += ["--size", args.size]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    if args.torch_threads:
        cmd += ["--torch-threads", str(args.torch_threads)]
    print(f"[offline] {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd, env=children_env(args))
    if done.returncode != 0:
        print(f"[offline] failed with exit code {done.returncode}", file=sys.stderr)
        return None
    return json.loads(out.read_text())


def children_env(args) -> dict[str, str]:
    """Environment of every server and of the offline run. With --torch-threads, OMP_NUM_THREADS
    too, which is how the naive server (which sets no thread count) gets the same limit."""
    updates = {"TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error"}
    if args.torch_threads:
        updates["OMP_NUM_THREADS"] = str(args.torch_threads)
    return child_env(**updates)


def system_command(name: str, args, model: str, port: int) -> list[str]:
    extra = ["--torch-threads", str(args.torch_threads)] if args.torch_threads else []
    if name == "diffserve-b1":
        return diffserve_command(model, port, 1, args.batch_delay_ms, extra)
    if name == "diffserve":
        return diffserve_command(model, port, args.max_batch_size, args.batch_delay_ms, extra)
    return naive_command(model, port, args.naive_threads, args.naive_copy_tokenizers)


def system_label(name: str, args) -> str:
    if name == "diffserve-b1":
        return "diffserve, max batch 1"
    if name == "diffserve":
        return f"diffserve, batch<={args.max_batch_size} {args.batch_delay_ms:g}ms"
    return "naive baseline"


def measure_levels(server: Server, name: str, args, record: dict) -> None:
    """The concurrency sweep against one healthy server."""
    for concurrency in args.concurrency:
        cfg = BenchConfig(
            base_url=server.base_url, num_prompts=args.num_requests, max_concurrency=concurrency,
            size=args.size, steps=args.steps, n=args.n, seed=args.seed, warmup=args.warmup,
            disable_tqdm=args.disable_tqdm, label=f"{name} c={concurrency}",
            timeout_s=args.request_timeout)
        try:
            result = asyncio.run(run_benchmark(cfg))
        except RuntimeError as error:  # every warm-up request failed
            print(f"[{name}] concurrency {concurrency}: {error}", file=sys.stderr)
            record["levels"].append({"concurrency": concurrency, "error": str(error)})
            continue
        result["concurrency"] = concurrency
        record["levels"].append(result)
        print(f"[{name}] concurrency {concurrency:>3}: {result['images_per_s']:.2f} img/s, "
              f"p50 {1000 * (result['latency_s']['p50'] or 0):.0f} ms, "
              f"p99 {1000 * (result['latency_s']['p99'] or 0):.0f} ms, "
              f"failed {result['failed']}", flush=True)


def run_systems(systems: list[str], args, model: str, out_dir: Path) -> list[dict]:
    """Start, measure and stop each system in turn. With --parallel-startup every server is
    launched at once (their start-ups overlap) but they are still measured one at a time."""
    servers: dict[str, Server] = {}
    records: dict[str, dict] = {}
    for name in systems:
        port = free_port()
        servers[name] = Server(system_command(name, args, model, port),
                               out_dir / "logs" / f"{name}.log", port,
                               startup_timeout_s=args.startup_timeout, env=children_env(args),
                               name=name)
        records[name] = {"system": name, "label": system_label(name, args),
                         "command": servers[name].cmd, "levels": []}
    try:
        for name in systems:
            if args.parallel_startup:
                print(f"[{name}] starting: {' '.join(servers[name].cmd[1:])}", flush=True)
                servers[name].launch()
        for name in systems:
            server, record = servers[name], records[name]
            if server.proc is None:
                print(f"[{name}] starting: {' '.join(server.cmd[1:])}", flush=True)
                server.launch()
            try:
                server.wait_ready()
            except ServerError as error:
                print(f"[{name}] {error}", file=sys.stderr)
                record["error"] = str(error)
                continue
            record["startup_s"] = server.startup_s
            print(f"[{name}] healthy after {server.startup_s:.1f} s", flush=True)
            measure_levels(server, name, args, record)
            if not args.parallel_startup:
                record["exit_code"] = server.stop()
    finally:
        for server in servers.values():
            server.interrupt()  # all at once: their shutdowns overlap
        for name, server in servers.items():
            code = server.stop()
            if "error" not in records[name]:
                records[name].setdefault("exit_code", code)
    return [records[name] for name in systems]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Measure diffserve (batched and max-batch-1), a naive baseline server and the "
                    "offline ceiling on the same model and load; print a table, write JSON and a "
                    "plot.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="Embedded model name (tiny-sd, tiny-flux) or a pipeline directory "
                             "(e.g. one built by benchmarks/models.py).")
    parser.add_argument("--size", default=None, help='"WIDTHxHEIGHT" (default: the model\'s native).')
    parser.add_argument("--steps", type=int, default=None,
                        help="num_inference_steps (default: the model's).")
    parser.add_argument("--n", type=int, default=1, help="Images per request.")
    parser.add_argument("--concurrency", default="1,4,16", help="Concurrency levels to sweep.")
    parser.add_argument("--num-requests", type=int, default=96,
                        help="Requests per concurrency level (after warm-up).")
    parser.add_argument("--warmup", type=int, default=4, help="Warm-up requests per level.")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="diffserve --dynamic-batch-max-size for the batched system.")
    parser.add_argument("--batch-delay-ms", type=float, default=8.0,
                        help="diffserve --dynamic-batch-delay-ms.")
    parser.add_argument("--naive-threads", type=int, default=None,
                        help="Thread pool size of the naive server (default: Python's default).")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch intra-op threads for every system and the offline run "
                             "(diffserve --torch-threads, OMP_NUM_THREADS for the naive server); "
                             "0 leaves each at its default (diffserve and bench_offline: all "
                             "cores). On a machine shared with other CPU work, 1 avoids the large "
                             "slowdowns of intra-op threads that wait on each other.")
    parser.add_argument("--naive-copy-tokenizers", action="store_true",
                        help="Run the naive server with --copy-tokenizers (by default it shares "
                             "them between threads, as the diffusers example server does, and "
                             "fails a request now and then under concurrency).")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"Which servers to measure, from {', '.join(SYSTEMS)}.")
    parser.add_argument("--offline-batch-sizes", default=None,
                        help="Batch sizes for the offline ceiling (default: powers of two up to "
                             "--max-batch-size, and it).")
    parser.add_argument("--offline-repeats", type=int, default=5, help="Timed offline calls per B.")
    parser.add_argument("--offline-warmup", type=int, default=2, help="Untimed offline calls per B.")
    parser.add_argument("--skip-offline", action="store_true", help="Do not run the offline ceiling.")
    parser.add_argument("--rounds", type=int, default=1,
                        help="Repeat everything this many times (servers in rotated order) and "
                             "report medians; ratios are taken within each round.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of prompts and images.")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="Longest wait for a server to become healthy, s.")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="Per-request timeout, s.")
    parser.add_argument("--parallel-startup", action="store_true",
                        help="Launch every server at once so that their start-ups overlap (they "
                             "are still measured one at a time; idle ones stay up meanwhile).")
    parser.add_argument("--output-dir", default=None,
                        help="Where results go (default: benchmarks/results/compare-<time>).")
    parser.add_argument("--no-plot", action="store_true", help="Skip the PNG plot.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bars.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.concurrency = _ints(args.concurrency, "--concurrency")
    args.offline_batch_sizes = (_ints(args.offline_batch_sizes, "--offline-batch-sizes")
                                if args.offline_batch_sizes else default_offline_sizes(args.max_batch_size))
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise SystemExit(f"compare.py: error: unknown systems {unknown}; choose from {SYSTEMS}")
    if min(args.num_requests, args.max_batch_size, args.n, args.rounds) < 1:
        raise SystemExit("compare.py: error: --num-requests, --max-batch-size, --n and --rounds "
                         "must be >= 1")
    out_dir = Path(args.output_dir or HERE / "results" / time.strftime("compare-%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)

    model = args.model
    from diffserve.models.embedded import EMBEDDED, PACKAGED, embedded_path

    if model in EMBEDDED:
        embedded_path(model)  # build it once now, not in three servers at once
    elif model not in PACKAGED and not Path(model).expanduser().is_dir():
        print(f"compare.py: note: {model!r} is not a packaged or embedded model or a directory; "
              "each system will try to load it as a hub id", file=sys.stderr)
    started = time.time()
    rounds = []
    for index in range(args.rounds):
        round_dir = out_dir if args.rounds == 1 else out_dir / f"round-{index + 1}"
        shift = index % len(systems)
        order = systems[shift:] + systems[:shift]
        if args.rounds > 1:
            print(f"=== round {index + 1}/{args.rounds}: "
                  f"{'' if args.skip_offline else 'offline, then '}{', '.join(order)}", flush=True)
        offline = None if args.skip_offline else run_offline(args, model, round_dir)
        by_name = {r["system"]: r for r in run_systems(order, args, model, round_dir)}
        runs = [by_name[name] for name in systems]
        rounds.append({"offline": offline, "runs": runs,
                       "summary": summarize(args, runs, offline)})
    if args.rounds == 1:
        runs, offline, summary = rounds[0]["runs"], rounds[0]["offline"], rounds[0]["summary"]
    else:
        runs, offline = merge_rounds(systems, rounds)
        summary = combine_summaries(args, runs, offline, rounds)
    report = {
        "model": model, "machine": machine_description(),
        "torch_version": (offline or {}).get("torch_version"),
        "config": {k: v for k, v in vars(args).items()},
        "systems": systems, "started": started, "duration_s": time.time() - started,
        "offline": offline, "runs": runs, "summary": summary,
        "rounds": rounds if args.rounds > 1 else None,
    }
    (out_dir / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    table = format_tables(args, runs, offline, summary)
    (out_dir / "compare.txt").write_text(table + "\n")
    print()
    print(f"model {model}, size {args.size or 'native'}, steps {args.steps or 'model default'}, "
          f"n={args.n}, {args.num_requests} requests per level, {args.rounds} round(s), torch threads "
          f"{args.torch_threads or 'default'}; {machine_description()['cpu']} x{os.cpu_count()}")
    print(table)
    if not args.no_plot:
        title = (f"{model}: size {args.size or 'native'}, steps {args.steps or 'default'}, "
                 f"{args.num_requests} requests/level")
        if plot(args, runs, offline, out_dir / "compare.png", title):
            print(f"\nplot: {out_dir / 'compare.png'}")
    print(f"results: {out_dir / 'compare.json'}")
    # Failed requests of the baseline are its own behaviour (see naive_server.py), shown in
    # the table; the exit status reports diffserve's and the tool's own failures.
    every_run = [r for rnd in rounds for r in rnd["runs"]]
    failed = any(r.get("error") for r in every_run) or any(
        "error" in lv or (lv.get("failed") and r["system"] != "naive")
        for r in every_run for lv in r.get("levels", []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
