"""A tool's inputs and outputs: the shared arguments (:func:`parser`), the prompts, the JSON it
writes (:func:`done`), the machine it ran on, and the report of its rounds (:func:`report`)."""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any, Callable

from kit.stats import Target, format_table, summarize

BENCHMARKS = Path(__file__).resolve().parents[1]


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
    "count": (count, "Requests per run."),
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
    lines = (BENCHMARKS / "prompts.txt").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def report(name: str, rounds: list[dict], args: argparse.Namespace, targets: list[Target] = ()) -> dict:
    """The summary of ``rounds`` (each with its ``figures``), printed as a table and written to --output-file."""
    summary = summarize([{k: v for k, v in r["figures"].items() if k != "error"} for r in rounds], targets)
    result = {"scenario": name, "config": vars(args), "machine": machine(), "summary": summary,
              "targets": [{"figure": f, "op": op, "bound": bound, "met": summary["verdicts"][f]}
                          for f, op, bound in targets], "rounds": rounds}
    done(args, result, "\n" + format_table(summary, targets))
    return result
