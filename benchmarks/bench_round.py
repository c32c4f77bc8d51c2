"""One round of a ``compare.py`` sitting: the servers it starts and the load it sends them
(``bench_serving``), every result kept. Shared by the scenarios of ``compare.py`` and
``traffic.py``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from pathlib import Path

from bench_serving import BenchConfig, run_benchmark
from figures import TREE, ms

from diffserve.launcher import ServerProcess, free_port

HERE = Path(__file__).resolve().parent


class Bench:
    """Starts servers for one round and runs bench_serving against them; keeps every result."""

    def __init__(self, args: argparse.Namespace, out_dir: Path, round_index: int) -> None:
        self.args, self.out_dir, self.round = args, out_dir, round_index
        self.runs: list[dict] = []
        self.failed = False

    def serve_args(self, overrides: dict[str, object]) -> list[str]:
        a = self.args
        opts = {"--model": a.model, "--torch-threads": a.torch_threads, "--log-level": "warning",
                "--dynamic-batch-max-size": a.max_batch_size, "--dynamic-batch-delay-ms": a.batch_delay_ms,
                **({"--batching-mode": a.batching_mode} if a.batching_mode else {}),
                **({"--set-policy": a.set_policy} if getattr(a, "set_policy", None) else {}),
                **({"--scheduling-policy": a.scheduling_policy}
                   if getattr(a, "scheduling_policy", None) else {}), **overrides}
        args = []
        for flag, value in opts.items():  # a list is a flag that takes several values
            args += [flag, *map(str, value if isinstance(value, (list, tuple)) else [value])]
        return args

    @contextlib.contextmanager
    def servers(self, name: str, *configs: dict | None):
        """Start one server per config (None: the naive baseline) together; yield their URLs."""
        a, procs = self.args, []
        for i, overrides in enumerate(configs):
            log = self.out_dir / "logs" / f"r{self.round}-{name.replace(' ', '_').replace('/', '_')}-{i}.log"
            kwargs = {"name": name, "startup_timeout_s": a.startup_timeout}
            if overrides is None:
                port = free_port()
                cmd = [sys.executable, str(HERE / "naive_server.py"), "--model", a.model, "--port", str(port)]
                kwargs["env"] = {"OMP_NUM_THREADS": str(a.torch_threads or os.cpu_count())}
                procs.append(ServerProcess(cmd, port, log, **kwargs))
            else:
                overrides = dict(overrides)
                tree = overrides.pop(TREE, None) or a.tree
                if tree:  # that checkout's diffserve, not this one's
                    kwargs["env"] = {"PYTHONPATH": str(Path(tree).resolve())}
                procs.append(ServerProcess.diffserve(*self.serve_args(overrides), log_path=log, **kwargs))
        with contextlib.ExitStack() as stack:
            for proc in procs:
                stack.callback(proc.stop)
                proc.launch()
            for proc in procs:
                proc.wait_ready()
            print(f"[{name}] ready after {max(p.startup_s for p in procs):.1f} s", flush=True)
            yield [proc.url for proc in procs], all(c is not None for c in configs)

    def load(self, served: tuple[list[str], bool], label: str, **overrides) -> dict:
        urls, ours = served
        a = self.args
        cfg = {"base_urls": urls, "num_prompts": a.num_requests, "size": a.size, "steps": a.steps,
               "seed": self.round, "warmup": a.warmup, "label": label, **overrides}
        result = asyncio.run(run_benchmark(BenchConfig(**cfg)))
        result["round"] = self.round
        self.runs.append(result)
        self.failed |= bool(result["failed"]) and ours  # the naive server's failures are its own
        lat = result["latency_s"]
        print(f"[{label}] {result['images_per_s']:.2f} img/s, p50 {ms(lat['p50']) or 0:.0f} ms, "
              f"p99 {ms(lat['p99']) or 0:.0f} ms, failed {result['failed']}", flush=True)
        return result
