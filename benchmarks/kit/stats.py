"""Figures: medians over rounds (:func:`summarize`), ratios, PSNR, target verdicts, and the tables a
tool prints."""

from __future__ import annotations

import math
import statistics

import numpy as np

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
