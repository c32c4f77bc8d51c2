"""int8-dynamic on a GPU: cuBLAS's int8 matmul refuses 16 rows or fewer, so the quantized layers
pad their rows to 17 (exactly: activations are scaled per row); torch's FLOP counter counts
``_int_mm``; and the remembered FLOP fit is keyed by the quantization scheme."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffserve.config.flags import ServerConfig
from diffserve.executor.accel import flops
from diffserve.executor.accel.quantized import INT8_ROWS, pad_int8_rows


class IntMatmuls(TorchDispatchMode):
    """The row counts of every ``_int_mm`` run inside."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._int_mm.default:
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


def _quantized():
    torchao = pytest.importorskip("torchao.quantization")
    from diffserve.executor.model.quantization import scheme_config

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.SiLU(), torch.nn.Linear(64, 32))
    torchao.quantize_(model, scheme_config(torchao, "int8-dynamic"))
    return model


def test_few_rows_are_padded_and_each_row_keeps_its_values():
    model = _quantized()
    inputs = [torch.randn(3, 64), torch.randn(1, 2, 64), torch.randn(40, 64)]
    with torch.inference_mode():
        before = [model(x) for x in inputs]
        assert pad_int8_rows("int8-weight-only", [model], "cuda:0") == 0  # no int8 matmul
        assert pad_int8_rows("int8-dynamic", [model], "cpu") == 0  # the CPU's takes any rows
        assert pad_int8_rows("int8-dynamic", [model], "cpu", force=True) == 2
        assert pad_int8_rows("int8-dynamic", [model], "cpu", force=True) == 0  # once a layer
        with IntMatmuls() as seen:
            after = [model(x) for x in inputs]
    assert seen.rows and min(seen.rows) >= INT8_ROWS, seen.rows
    assert 40 in seen.rows  # enough rows: as they are
    for a, b in zip(after, before):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_flop_counter_counts_int8_matmuls():
    from torch.utils.flop_counter import FlopCounterMode

    flops.count_int8()
    a = torch.randint(-8, 8, (32, 64), dtype=torch.int8)
    b = torch.randint(-8, 8, (64, 16), dtype=torch.int8)
    with FlopCounterMode(display=False) as counter:
        torch._int_mm(a, b)
    assert counter.get_total_flops() == 2 * 32 * 64 * 16


def test_the_flop_fit_is_remembered_per_quantization_scheme(monkeypatch, tmp_path):
    from diffserve.executor import runtime
    from diffserve.executor.checks import verdicts

    monkeypatch.setattr(verdicts, "cache_root", lambda: tmp_path)
    keys = []
    monkeypatch.setattr(runtime.verdicts, "key_for", lambda model, what: keys.append(what) or None)
    monkeypatch.setattr(runtime.flops, "fit", lambda rt: None)
    rt = type("Rt", (), {"loaded": type("L", (), {"pipeline_class": "FluxPipeline"}), "group": None})
    for scheme in ("none", "int8-dynamic"):
        runtime._flop_model(rt, ServerConfig(model="tiny-flux", quantization=scheme))
    assert keys[0] != keys[1] and keys[1]["quantization"][0] == "int8-dynamic"
