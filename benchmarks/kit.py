"""What the tools in benchmarks/ share, so that each tool is only its scenario: arguments
(:func:`parser`), servers and load on the OpenAI images API with the /metrics delta (:class:`Bench`,
:func:`run_load`), medians over rounds with target verdicts (:func:`main`, :func:`report`), the
plain pipeline alone (:func:`reference`) and the engines in this process (:func:`runtime`,
:func:`items`, :func:`stepped`). A server-load scenario is a function of a :class:`Bench`::

    def dp2(b: kit.Bench) -> dict:
        with b.servers("dp2", {"--data-parallel-size": 2}) as served:
            return {"img/s, dp2": b.load(served, "dp2", max_concurrency=b.args.concurrency)["images_per_s"]}

    kit.main(__doc__, {"dp2": kit.Scenario(dp2, [("img/s, dp2", ">=", 10.0)])}, num_requests=64, concurrency=16)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import io
import json
import math
import os
import platform
import random
import select
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple

import aiohttp
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from diffserve.config import DEFAULT_MODEL, ServerConfig
from diffserve.executor.model.loading import load_model
from diffserve.executor.runtime import build_runtime
from diffserve.launcher import LaunchError, ServerProcess, free_port
from diffserve.models.registry import resolve_model, serving_defaults
from diffserve.work import ImageRequest, Work, WorkItem

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE.parent))  # tools/ (random LoRA adapters)
sys.path.append(str(HERE.parent / "tests"))  # reference.py (the plain pipeline alone), after all else

# -- arguments and output ------------------------------------------------------------------------


def csv(kind: Callable[[str], Any] = str) -> Callable[[str], list]:
    """An argument type: a comma-separated list of ``kind``."""
    return lambda text: [kind(v.strip()) for v in text.split(",") if v.strip()]


def count(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 1")
    return int(text)


ints, floats, names, counts = csv(int), csv(float), csv(str), csv(count)

ARGS = {  # the shared arguments: name -> (type, help[, choices]); a tool names those it takes
    "model": (str, "Embedded model, pipeline directory or hub id."),
    "size": (str, '"WIDTHxHEIGHT" (None: the model\'s).'),
    "steps": (int, "num_inference_steps (None: the model's)."),
    "num_requests": (count, "Requests per measurement."),
    "concurrency": (count, "Closed-loop concurrency (saturation)."),
    "warmup": (int, "Untimed requests per server (or runs) first."),
    "repeats": (count, "Timed runs per measurement."),
    "rounds": (count, "Rounds, each with fresh servers (or state); figures are their medians."),
    "batch_sizes": (counts, "Comma-separated images per batch."),
    "count": (count, "Requests (edits) per run, one at a time or at once."),
    "side": (int, "Side of the edits' inputs and outputs, pixels."),
    "torch_threads": (int, "torch intra-op threads per executor (0: torch's default)."),
    "max_batch_size": (int, "Most images in a batch (the servers' --dynamic-batch-max-size)."),
    "batch_delay_ms": (float, "The servers' --dynamic-batch-delay-ms."),
    "batching_mode": (str, "The servers' --batching-mode (None: theirs).", ("auto", "step", "request")),
    "set_policy": (str, "The servers' --set-policy (step mode: which running set a step advances)."),
    "scheduling_policy": (str, "The servers' --scheduling-policy."),
    "tree": (str, "Run the servers from this checkout of the project (e.g. a worktree of an earlier commit)."),
    "startup_timeout": (float, "Longest server start, s."),
    "output_file": (str, "Write the results as JSON here."),
    "output_dir": (str, "JSON, markdown and server logs (None: benchmarks/results/<scenario>-<time>)."),
}
# Of those, the server flags: each server a Bench starts gets the ones its tool takes.
SERVER_FLAGS = {"model": "--model", "torch_threads": "--torch-threads", "max_batch_size": "--dynamic-batch-max-size",
                "batch_delay_ms": "--dynamic-batch-delay-ms", "batching_mode": "--batching-mode",
                "set_policy": "--set-policy", "scheduling_policy": "--scheduling-policy"}


def parser(doc: str, **defaults) -> argparse.ArgumentParser:
    """A tool's parser, described by the first paragraph of ``doc``, with the shared arguments
    named in ``defaults`` at the tool's defaults."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name, default in defaults.items():
        kind, text, *choices = ARGS[name]
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=text,
                       choices=choices[0] if choices else None)
    return p


def write_json(path: str | Path | None, data: Any) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def done(args: argparse.Namespace, result: dict, shown: Any = None, code: int = 0) -> int:
    """A standalone tool's end: ``shown`` printed (as JSON unless text), ``result`` to --output-file."""
    if shown is not None:
        print(shown if isinstance(shown, str) else json.dumps(shown, indent=1))
    write_json(args.output_file, result)
    return code


def machine() -> dict:
    """What a figure was measured on (the load average says how busy the machine was)."""
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg()}


def prompts() -> list[str]:
    lines = (HERE / "prompts.txt").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


# -- figures -------------------------------------------------------------------------------------

Target = tuple[str, str, float]  # (figure, ">=" or "<=", bound)


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Of two images' pixels, in dB."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def num(value: float | None) -> str:
    """A figure as the tables show it."""
    return "n/a" if value is None else f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def judge(value: float | None, op: str, bound: float) -> bool | None:
    """True (met), False (missed) or None (not measured)."""
    return None if value is None else (value >= bound if op == ">=" else value <= bound)


def summarize(rounds: list[dict[str, float | None]], targets: list[Target] = ()) -> dict:
    """Medians over rounds of every figure (a ratio is taken within its round, so a machine whose
    speed drifts between rounds moves it less), and each target's verdict on its median."""
    by_round = {name: [r.get(name) for r in rounds] for name in dict.fromkeys(n for r in rounds for n in r)}
    medians = {name: median(values) for name, values in by_round.items()}
    return {"medians": medians, "by_round": by_round,
            "verdicts": {name: judge(medians.get(name), op, bound) for name, op, bound in targets}}


def format_table(summary: dict, targets: list[Target] = ()) -> str:
    bounds = {name: f"{op} {bound:g}" for name, op, bound in targets}
    word = {True: "met", False: "**MISSED**", None: "not measured"}
    rows = ["| figure | median | by round | target | verdict |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| {name} | {num(value)} | {', '.join(num(v) for v in summary['by_round'][name])} | "
             f"{bounds.get(name, '')} | {word[summary['verdicts'][name]] if name in bounds else ''} |"
             for name, value in summary["medians"].items()]
    rows += [f"| {name} | n/a | | {bounds[name]} | not measured |" for name in bounds if name not in summary["medians"]]
    return "\n".join(rows)


def table(rows: list[dict]) -> str:
    """``rows`` as a markdown table, a column per key any of them has."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)] + [
        "| " + " | ".join(num(v) if isinstance(v, float) else str(v) for v in (r.get(k, "") for k in keys)) + " |"
        for r in rows])


def report(name: str, rounds: list[dict], args: argparse.Namespace, targets: list[Target] = ()) -> dict:
    """The summary of ``rounds`` (each with its ``figures``), printed as a table and written to --output-file."""
    summary = summarize([{k: v for k, v in r["figures"].items() if k != "error"} for r in rounds], targets)
    result = {"scenario": name, "config": vars(args), "machine": machine(), "summary": summary,
              "targets": [{"figure": f, "op": op, "bound": bound, "met": summary["verdicts"][f]}
                          for f, op, bound in targets], "rounds": rounds}
    done(args, result, "\n" + format_table(summary, targets))
    return result


# -- servers -------------------------------------------------------------------------------------


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
                    [sys.executable, str(HERE / "naive_server.py"), "--model", a.model, "--port", str(port)], port,
                    log, env={"OMP_NUM_THREADS": str(a.torch_threads or os.cpu_count())}, name=name,
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
    out_dir = Path(args.output_dir or HERE / "results" / time.strftime(f"{name}-%Y%m%d-%H%M%S"))
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


# -- load ----------------------------------------------------------------------------------------

ENDPOINT = "/v1/images/generations"


@dataclass
class Load:
    """A load on the OpenAI images API; its fields are a run's JSON ``config``."""

    base_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])  # round-robin
    num_prompts: int = 200
    max_concurrency: int | None = None  # None: no limit
    request_rate: float = math.inf  # of Poisson arrivals, requests/s; inf: all at once
    size: str | None = None
    steps: int | None = None
    mixed_steps: list[int] | None = None  # each request draws its steps from these (seeded)
    sizes: list[str] | None = None  # mixed: in turn, or drawn with size_weights (seeded)
    size_weights: list[float] | None = None
    models: list[str] | None = None  # `model` of request i: models[i % len] (e.g. LoRA adapters)
    n: int = 1
    seed: int = 0
    warmup: int = 2  # per base URL
    output_format: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # e.g. an API key
    timeout_s: float = 600.0
    label: str | None = None


def payloads(cfg: Load, total: int, rng: random.Random) -> list[dict[str, Any]]:
    """``total`` request bodies: prompts from prompts.txt (shuffled, cycled), distinct seeds (n
    from each), and each one's steps and size, drawn with ``rng`` where they are mixed."""
    pool, chosen, bodies = prompts(), [], []
    while len(chosen) < total:
        chosen += rng.sample(pool, len(pool))
    for i, prompt in enumerate(chosen[:total]):
        steps = rng.choice(cfg.mixed_steps) if cfg.mixed_steps else cfg.steps  # drawn first, then the size
        size = cfg.sizes[i % len(cfg.sizes)] if cfg.sizes else cfg.size
        if cfg.sizes and cfg.size_weights:
            size = rng.choices(cfg.sizes, cfg.size_weights)[0]
        body = {"prompt": prompt, "n": cfg.n, "seed": cfg.seed * 1_000_003 % 2**31 + i * cfg.n,
                "num_inference_steps": steps, "size": size, "output_format": cfg.output_format,
                "model": cfg.models[i % len(cfg.models)] if cfg.models else None}
        bodies.append({**{k: v for k, v in body.items() if v is not None}, **cfg.extra_body})
    return bodies


async def send(client: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One request: {ok, latency_s, images, error}. Latency ends with the body read and parsed."""
    start = time.perf_counter()
    try:
        async with client.post(url + ENDPOINT, json=body) as response:
            raw, status = await response.read(), response.status
        if status != 200:
            images, error = 0, f"HTTP {status}: {raw[:300].decode('utf-8', 'replace')}"
        else:
            images = sum(1 for d in json.loads(raw).get("data") or [] if d.get("b64_json") or d.get("url"))
            error = None if images == body["n"] else f"expected {body['n']} images, got {images}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        images, error = 0, f"{type(e).__name__}: {e}"[:200]
    return {"ok": error is None, "latency_s": time.perf_counter() - start, "images": images, "error": error}


async def drive(one: Callable[[int], Any], total: int, rate: float = math.inf, concurrency: int | None = None,
                rng: random.Random | None = None) -> list:
    """``await one(i)`` for i < total at Poisson arrivals of ``rate``/s drawn from ``rng`` (the
    first at once; inf: all at once), at most ``concurrency`` in flight (a closed loop): the
    results in order. The wait for a free slot is not in ``one``'s time."""
    arrivals = [0.0] * total
    if not math.isinf(rate):
        arrivals = list(np.cumsum([0.0] + [rng.expovariate(rate) for _ in range(total - 1)]))[:total]
    limit = asyncio.Semaphore(concurrency or max(total, 1))

    async def gated(i: int):
        async with limit:
            return await one(i)

    start, tasks = time.perf_counter(), []
    for i, at in enumerate(arrivals):
        if (delay := start + at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(gated(i)))
    return list(await asyncio.gather(*tasks))


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(("count", "mean", "p50", "p90", "p99", "max"))
    a = np.asarray(values)
    return {"count": len(values), "mean": float(a.mean()),
            **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}, "max": float(a.max())}


async def run_load(cfg: Load) -> dict[str, Any]:
    """A warm-up, then ``cfg``: throughput, latency (overall, per step count, per size), the /metrics delta."""
    if cfg.num_prompts < 1 or (cfg.max_concurrency or 1) < 1 or not cfg.request_rate > 0:
        raise ValueError("num_prompts and max_concurrency must be >= 1 and request_rate > 0")
    urls, rng = [u.rstrip("/") for u in cfg.base_urls], random.Random(cfg.seed)
    warm = payloads(cfg, cfg.warmup * len(urls), random.Random(cfg.seed - 1))
    bodies = payloads(cfg, cfg.num_prompts, rng)
    slots = min(cfg.max_concurrency or len(bodies), len(bodies))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=slots + 4), headers=cfg.headers,
                                     timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as client:
        if warm:
            done = await drive(lambda i: send(client, urls[i % len(urls)], warm[i]), len(warm), concurrency=slots)
            if not any(o["ok"] for o in done):
                raise RuntimeError(f"every warm-up request failed; first error: {done[0]['error']}")
        before, start = metrics(*urls), time.perf_counter()  # nothing is in flight while they are read
        outcomes = await drive(lambda i: send(client, urls[i % len(urls)], bodies[i]), len(bodies),
                               cfg.request_rate, cfg.max_concurrency, rng)
        duration = time.perf_counter() - start
        after = metrics(*urls)
    ok = [(b, o) for b, o in zip(bodies, outcomes) if o["ok"]]
    of = lambda key, value: percentiles([o["latency_s"] for b, o in ok if b.get(key) == value])  # noqa: E731
    latency, images = percentiles([o["latency_s"] for _, o in ok]), sum(o["images"] for _, o in ok)
    return {"label": cfg.label, "base_urls": urls, "duration_s": duration,
            "config": {**asdict(cfg), "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate},
            "completed": len(ok), "failed": len(outcomes) - len(ok), "images": images,
            "requests_per_s": len(ok) / duration, "images_per_s": images / duration, "latency_s": latency,
            "latency_by_steps_s": {str(k): of("num_inference_steps", k) for k in sorted(set(cfg.mixed_steps or []))},
            "latency_by_size_s": {size: of("size", size) for size in dict.fromkeys(cfg.sizes or [])},
            "latencies_s": [round(o["latency_s"], 6) for _, o in ok],
            "errors": dict(Counter(o["error"] for o in outcomes if not o["ok"])),
            "server_metrics": metrics_delta(before, after, duration, latency["mean"])}


async def image(client: aiohttp.ClientSession, url: str, body: dict | None, endpoint=ENDPOINT, **kwargs) -> np.ndarray:
    """The first image of one answer, as RGB pixels (an error status raises)."""
    async with client.post(url + endpoint, json=body, raise_for_status=True, **kwargs) as response:
        b64 = (await response.json())["data"][0]["b64_json"]
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def session() -> aiohttp.ClientSession:
    """A client for a tool's own requests, patient with a busy machine."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))


# -- /metrics ------------------------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, sorted labels) -> value
# Not a metric of the server's: the executors of the servers read, each counted once. Their series
# exist from start-up, so the count does not depend on whether one had finished loading (its readiness would).
EXECUTORS = ("executors", ())


def parse_metrics(text: str, into: Samples | None = None) -> Samples:
    """Every sample of the exposition ``text``, added to ``into`` (a sum over servers)."""
    samples, executors = {} if into is None else into, set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            samples[key] = samples.get(key, 0.0) + s.value
            if s.name == "diffserve_executor_ready":
                executors.add(s.labels.get("executor"))
    samples[EXECUTORS] = samples.get(EXECUTORS, 0.0) + len(executors)
    return samples


def total(samples: Samples, name: str, **match: str) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``match``; None if there are none."""
    values = [v for (n, labels), v in samples.items() if n == name and all(kv in labels for kv in match.items())]
    return sum(values) if values else None


def change(before: Samples, after: Samples, name: str, **match: str) -> float | None:
    """How much :func:`total` of ``name`` grew from ``before`` to ``after``; None if it is in neither."""
    a = total(after, name, **match)
    return None if a is None else a - (total(before, name, **match) or 0.0)


def metrics(*urls: str) -> Samples | None:
    """diffserve's metrics now, summed over ``urls`` (each counted once); None where one has none (naive)."""
    samples: Samples = {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy the environment names
    for url in dict.fromkeys(u.rstrip("/") for u in urls):
        try:
            with opener.open(url + "/metrics", timeout=10) as response:
                text = response.read().decode()
        except urllib.error.HTTPError:
            text = ""
        if "diffserve_batch_size" not in text:
            return None
        parse_metrics(text, samples)
    return samples


def metrics_delta(before: Samples | None, after: Samples | None, duration_s: float,
                  client_mean_latency_s: float | None = None) -> dict | None:
    """What the servers did between two snapshots ``duration_s`` apart, and where a request's
    time went given the client's mean latency."""
    if before is None or after is None:
        return None
    grew = functools.partial(change, before, after)

    def mean(name: str) -> float | None:
        s, n = grew(name + "_sum"), grew(name + "_count")
        return s / n if s is not None and n else None

    def by_label(name: str, label: str) -> dict[str, float]:
        """The nonzero changes of ``name`` per value of ``label``."""
        values = sorted({dict(labels).get(label) for n, labels in after if n == name} - {None})
        return {v: d for v in values if (d := grew(name, **{label: v}))}

    executors, busy = after.get(EXECUTORS) or 1.0, grew("diffserve_executor_busy_seconds_total")
    d = {"batching_mode": ",".join(sorted(dict(labels)["mode"] for (n, labels), v in after.items()
                                          if n == "diffserve_batching_mode" and v)),
         "executors": executors, "dispatches": grew("diffserve_batch_size_count"),
         "dispatches_by_reason": by_label("diffserve_dispatches_total", "reason"),
         "mean_batch_size": mean("diffserve_batch_size"),
         "mean_step_running_images": mean("diffserve_step_running_images"),
         "mean_queue_time_s": mean("diffserve_queue_time_seconds"),
         "mean_batch_execution_s": mean("diffserve_batch_execution_seconds"),
         "mean_request_execution_s": mean("diffserve_request_execution_seconds"),
         "mean_server_latency_s": mean("diffserve_request_latency_seconds"),
         "images_generated": grew("diffserve_images_generated_total"),
         "requests_by_status": by_label("diffserve_requests_total", "status"),
         # Share of the run the executors spent computing: what the server loses to its own gaps.
         "executor_busy_fraction": None if busy is None or duration_s <= 0 else busy / duration_s / executors,
         "mean_server_overhead_s": None, "mean_client_and_http_s": None}
    if None not in (client_mean_latency_s, d["mean_server_latency_s"], d["mean_queue_time_s"],
                    d["mean_request_execution_s"]):
        # Per request: the client and HTTP (client latency over the frontend's), and the server's
        # own work besides waiting and computing (validation, IPC, image encoding).
        d["mean_client_and_http_s"] = client_mean_latency_s - d["mean_server_latency_s"]
        d["mean_server_overhead_s"] = (d["mean_server_latency_s"] - d["mean_queue_time_s"]
                                       - d["mean_request_execution_s"])
    return d


# -- in process ----------------------------------------------------------------------------------


@functools.cache
def reference(model: str, torch_threads: int = 0) -> SimpleNamespace:
    """The model's plain pipeline, loaded once in this process: ``images(request, ...)``, a request's
    images from it alone (tests/reference.py), and ``diff(a, b)``, the largest pixel difference."""
    from diffserve.executor.checks.reference import max_diff, solo

    loaded = load_model(model, torch_threads=torch_threads)
    return SimpleNamespace(loaded=loaded, images=functools.partial(solo, loaded, {}), diff=max_diff)


def runtime(model: str, torch_threads: int = 0, **config):
    """``model`` built as an executor builds it, in this process (``config``: ServerConfig's fields)."""
    return build_runtime(ServerConfig(model=model, **config), torch_threads=torch_threads)


def items(rt, n: int, tag: str = "r", steps: int | None = None, first: int = 0, **fields) -> list:
    """``n`` one-image work items for ``rt``'s model: seeds from ``first``, prompts from
    prompts.txt, the model's size, guidance and (without ``steps``) steps; ``fields`` over them."""
    info, pool = rt.info, prompts()
    return [WorkItem(ImageRequest(**{
        "request_id": f"{tag}-{first + i}", "model": info.name, "width": info.width, "height": info.height,
        "num_inference_steps": steps or info.default_steps, "guidance_scale": info.default_guidance_scale,
        "prompt": pool[i % len(pool)], "seed": first + i, "num_frames": info.num_frames, **fields}), 0, 1)
        for i in range(n)]


def stepped(engine, arrivals: dict[int, list], each=lambda out: None, inputs=lambda item: []) -> list:
    """The outcomes of the work items ``arrivals`` admits before each step (by its index), stepped to
    the end; ``each(out)`` after every step. Waits, as the executor's loop does, where only a stage works."""
    outcomes, step, last = [], 0, max(arrivals, default=0)
    while engine or step <= last:
        if arriving := arrivals.get(step):
            outcomes += engine.admit(arriving, [inputs(item) for item in arriving])
        if not engine.steppable and engine.stage_pending:
            select.select([engine.wakeup.read_fd], [], [], 600)
            engine.wakeup.clear()
        out = engine.step()
        each(out)
        outcomes += out.finished
        step += 1
    return outcomes


def timed(run: Callable[[], Any], sync: bool = False) -> tuple[float, Any]:
    """(seconds, result) of ``run()``; ``sync``: the CUDA device's queued work included."""
    start = time.perf_counter()
    result = run()
    if sync:
        import torch

        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def run(rt, its: list, mode: str = "step") -> list:
    """The outcomes of work items ``its`` in ``rt``'s engine of ``mode`` (request: one pipeline call)."""
    if mode == "request":
        return rt.request_runner().execute(Work(0, its), [[] for _ in its])
    return stepped(rt.step_engine(), {0: its})
