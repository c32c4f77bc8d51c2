"""The figures' arithmetic shared by the scenarios: medians, ratios and target verdicts."""

from __future__ import annotations

import statistics

TREE = "tree"  # in a server's overrides: run that one from another checkout (see --tree)


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def judge(value: float | None, op: str, bound: float) -> bool | None:
    """True (met), False (missed) or None (not measured)."""
    return None if value is None else (value >= bound if op == ">=" else value <= bound)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds
