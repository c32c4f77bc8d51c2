"""A round's servers and load (:class:`Bench`), and a server-load tool's ``main``: its scenario
(:class:`Scenario`) over rounds of fresh servers, to JSON and markdown."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from diffserve.config.flags import DEFAULT_MODEL
from diffserve.serving.launcher import LaunchError, ServerProcess, free_port
from diffserve.builders.registry import resolve_model, serving_defaults
from kit.cli import BENCHMARKS, parser, report, write_json
from kit.loadgen import Load, run_load
from kit.stats import Target, format_table, ms

# Of the shared arguments (kit.cli.ARGS), the server flags: each server a Bench starts gets the
# ones its tool takes.
SERVER_FLAGS = {"model": "--model", "torch_threads": "--torch-threads", "max_batch_size": "--dynamic-batch-max-size",
                "batch_delay_ms": "--dynamic-batch-delay-ms", "batching_mode": "--batching-mode",
                "set_policy": "--set-policy", "scheduling_policy": "--scheduling-policy"}


def server(*flags: object, log: str | Path | None = None, name: str = "diffserve", tree: str | None = None,
           env: dict[str, str] | None = None, startup_timeout: float = 600.0) -> ServerProcess:
    """``diffserve serve *flags`` on a free port, its output in ``log`` (a temporary file by
    default): ``with`` starts it, waits for /health and stops it. ``tree``: that checkout's diffserve."""
    log = log or Path(tempfile.mkdtemp(prefix="diffserve-bench-")) / "server.log"
    env = {**(env or {}), **({"PYTHONPATH": str(Path(tree).resolve())} if tree else {})}
    return ServerProcess.diffserve(*map(str, flags), log_path=log, name=name, env=env,
                                   startup_timeout_s=startup_timeout)


class Served(NamedTuple):
    urls: list[str]
    ours: bool  # all diffserve (the naive baseline's failures are its own)


class Bench:
    """One round of a scenario: starts servers and loads them, every result kept in ``runs``;
    ``failed`` once a diffserve server fails a request (or the scenario says so)."""

    def __init__(self, args: argparse.Namespace, out_dir: Path, round_index: int = 1) -> None:
        self.args, self.out_dir, self.round, self.runs, self.failed = args, out_dir, round_index, [], False

    @contextlib.contextmanager
    def servers(self, name: str, *configs: dict | None):
        """One server per config (None: the naive baseline), started side by side; yields
        :class:`Served`. A config's flags (a list: several values) go after the tool's shared ones."""
        a, procs = self.args, []
        shared = {"--log-level": "warning", **{flag: v for key, flag in SERVER_FLAGS.items()
                                               if (v := getattr(a, key, None)) is not None}}
        for i, overrides in enumerate(configs):
            log = self.out_dir / "logs" / f"r{self.round}-{name.replace(' ', '_').replace('/', '_')}-{i}.log"
            if overrides is None:
                port = free_port()
                procs.append(ServerProcess(
                    [sys.executable, str(BENCHMARKS / "naive_server.py"), "--model", a.model, "--port", str(port)],
                    port, log, env={"OMP_NUM_THREADS": str(a.torch_threads or os.cpu_count())}, name=name,
                    startup_timeout_s=a.startup_timeout))
            else:
                flags = [s for flag, v in {**shared, **overrides}.items()
                         for s in (flag, *(v if isinstance(v, (list, tuple)) else [v]))]
                procs.append(server(*flags, log=log, name=name, tree=getattr(a, "tree", None),
                                    startup_timeout=a.startup_timeout))
        with contextlib.ExitStack() as stack:
            for proc in procs:
                stack.callback(proc.stop)
                proc.launch()
            for proc in procs:
                proc.wait_ready()
            print(f"[{name}] ready after {max(p.startup_s for p in procs):.1f} s", flush=True)
            yield Served([proc.url for proc in procs], all(c is not None for c in configs))

    def load(self, served: Served, label: str, **overrides) -> dict:
        """:func:`run_load` on ``served``: the tool's --num-requests, --warmup, --size and --steps
        (where it has them), the round as the seed, ``overrides`` over them."""
        a = self.args
        result = asyncio.run(run_load(Load(**{
            "base_urls": served.urls, "num_prompts": getattr(a, "num_requests", None), "size": getattr(a, "size", None),
            "steps": getattr(a, "steps", None), "seed": self.round, "warmup": getattr(a, "warmup", 0), "label": label,
            **overrides})))
        result["round"] = self.round
        self.runs.append(result)
        self.failed |= bool(result["failed"]) and served.ours
        lat = result["latency_s"]
        print(f"[{label}] {result['images_per_s']:.2f} img/s, p50 {ms(lat['p50']) or 0:.0f} ms, "
              f"p99 {ms(lat['p99']) or 0:.0f} ms, failed {result['failed']}", flush=True)
        return result


@dataclass
class Scenario:
    run: Callable[[Bench], dict[str, float | None]]  # one round's figures
    targets: list[Target] = field(default_factory=list)
    after: Callable[[dict, argparse.Namespace, Path, str], None] = lambda *_: None  # e.g. a plot


def main(doc: str, scenarios: dict[str, Scenario], argv: list[str] | None = None,
         arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None, **shared) -> int:
    """A server-load tool: its scenario (named first where it has several) over --rounds rounds of
    fresh servers, to <scenario>.json and .md in --output-dir; ``arguments`` adds the tool's own."""
    p = parser(doc, **{"model": DEFAULT_MODEL, "rounds": 1, "startup_timeout": 600.0, "output_dir": None,
                       "output_file": None, **shared})
    if len(scenarios) > 1:
        p.add_argument("scenario", choices=scenarios)
    arguments(p)
    args = p.parse_args(argv)
    name = getattr(args, "scenario", next(iter(scenarios)))
    # Built once here rather than by several servers at once; the steps a request runs by default.
    args.default_steps = int(serving_defaults(resolve_model(args.model)).get("num_inference_steps", 20))
    out_dir = Path(args.output_dir or BENCHMARKS / "results" / time.strftime(f"{name}-%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    scenario, rounds, failed = scenarios[name], [], False
    for index in range(1, args.rounds + 1):
        print(f"=== {name}, round {index}/{args.rounds}", flush=True)
        bench = Bench(args, out_dir, index)
        try:
            figures = scenario.run(bench)
        except (LaunchError, RuntimeError, OSError) as error:
            print(f"round {index} failed: {error}", file=sys.stderr)
            figures, bench.failed = {"error": str(error)}, True
        failed |= bench.failed
        rounds.append({"figures": figures, "runs": bench.runs})
    result = report(name, rounds, args, scenario.targets)
    title = ", ".join(filter(None, (
        f"{name}: {args.model}", hasattr(args, "steps") and f"steps {args.steps or args.default_steps}",
        hasattr(args, "num_requests") and f"{args.num_requests} requests/measurement", f"{args.rounds} round(s)")))
    write_json(out_dir / f"{name}.json", result)
    (out_dir / f"{name}.md").write_text(f"# {title}\n\n{format_table(result['summary'], scenario.targets)}\n")
    scenario.after(result["summary"], args, out_dir, title)
    print(f"results: {out_dir / (name + '.json')}")
    return 1 if failed else 0
