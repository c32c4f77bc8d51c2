"""The executor's process set-up: the OpenMP spin bound is set before torch loads, an
operator's own OpenMP settings win, and PEFT and torchao stay unimported where unused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diffserve.processes import OPENMP_SPIN_COUNT

_PROBE = ("import os; from diffserve.processes import bound_openmp_spin; "
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


_LIBRARIES = ("import sys; from diffserve.executor.model.loading import leave_out_unused_libraries; "
              "leave_out_unused_libraries({adapters}, {quantization!r}); "
              "from diffusers import DiffusionPipeline; "
              "from diffusers.utils import is_peft_available, is_torchao_available; "
              "print(is_peft_available(), is_torchao_available(), "
              "sys.modules.get('peft') is not None, sys.modules.get('torchao') is not None)")


def test_peft_and_torchao_are_left_out_where_unused():
    """An executor that serves no adapters and quantizes nothing (the adapter and quantization
    servers' tests are the other case: they need both libraries imported)."""
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    code = _LIBRARIES.format(adapters=False, quantization="none")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False False False False"
    assert "torchao" not in done.stderr  # no warnings about kernels this machine lacks
