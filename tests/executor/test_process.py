"""The executor's process set-up: the OpenMP spin bound is set before torch loads, and an
operator's own OpenMP settings win."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diffserve.executor.process import OPENMP_SPIN_COUNT

_PROBE = ("import os; from diffserve.executor.process import bound_openmp_spin; "
          "bound_openmp_spin(); import torch; "
          "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")


def _run(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]


@pytest.mark.parametrize("env, expected", [
    ({}, f"{OPENMP_SPIN_COUNT} None"),
    ({"GOMP_SPINCOUNT": "123"}, "123 None"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "None ACTIVE"),
])
def test_spin_bound_unless_the_operator_chose(env, expected):
    assert _run(**env) == expected
