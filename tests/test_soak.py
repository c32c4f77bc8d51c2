"""Soak runs of benchmarks/soak.py: nothing lost, every image its own. CI runs the short one;
the full 2,000-request run is marked slow (`python -m pytest -m slow`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def run_soak(*args: str) -> dict:
    proc = subprocess.run([sys.executable, str(SOAK), *args], capture_output=True, text=True,
                          timeout=1800)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (summary, proc.stderr[-3000:])
    assert summary["lost"] == summary["failed"] == summary["mismatched"] == 0
    return summary


def test_short_soak():
    summary = run_soak("--num-requests", "200", "--concurrency", "32", "--distinct", "24")
    assert summary["executor_calls"] < summary["requests"]


@pytest.mark.slow
def test_full_soak():
    run_soak("--num-requests", "2000", "--concurrency", "64")
