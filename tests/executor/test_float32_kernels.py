"""The start-up check's float32 reference runs on kernels that take float32: native attention in
place of a half-only kernel (cuDNN, torch-flash, flash and flash3 refuse float32 on a GPU), and
the compiled blocks' own forwards (no second set of graphs for float32 inputs)."""

from __future__ import annotations

import pytest
import torch

from diffserve.config.flags import ServerConfig
from diffserve.executor.accel.compiled import CompiledBlocks
from diffserve.executor.checks import verdicts as check_verdicts
from diffserve.executor.runtime import build_runtime
from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines


@pytest.fixture
def half_only_math(monkeypatch):
    """The ``math`` kernel made to refuse float32, as a half-only GPU kernel does."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    name = AttentionBackendName._NATIVE_MATH
    original = _AttentionBackendRegistry._backends[name]
    calls = []

    def half_only(query, *args, **kwargs):
        calls.append(query.dtype)
        if query.dtype == torch.float32:
            raise RuntimeError("this kernel takes float16 or bfloat16 only")
        return original(query, *args, **kwargs)

    monkeypatch.setitem(_AttentionBackendRegistry._backends, name, half_only)
    return calls


def test_a_half_only_kernel_keeps_step_mode_and_the_verdict(half_only_math, monkeypatch,
                                                            tmp_path):
    monkeypatch.setattr(check_verdicts, "cache_root", lambda: tmp_path)  # the check runs
    config = ServerConfig(model="tiny-flux", dtype="bfloat16", attention_backend="math",
                          batching_mode="auto")
    rt = build_runtime(config, torch_threads=1)
    assert torch.bfloat16 in half_only_math and torch.float32 not in half_only_math
    assert rt.mode == "step" and not rt.fallback, rt.fallback
    assert set(rt.info.task_modes.values()) == {"step"}
    # The chosen kernel serves again after the reference.
    backends = {str(m.processor._attention_backend.value) for m in rt.family.denoiser.modules()
                if hasattr(getattr(m, "processor", None), "_attention_backend")}
    assert backends == {"_native_math"}
    # The remembered verdict is a pass: the next start recalls no fallback.
    remembered = check_verdicts.recall(check_verdicts.key_of(rt, config))
    assert remembered is not None and not remembered["fallback"], remembered


def test_the_float32_reference_compiles_no_graphs_of_its_own():
    loaded = load_model("tiny-flux", torch_threads=1)
    fam = family_for(loaded.pipeline_class)(loaded.pipe, task_pipelines(loaded.pipe),
                                            loaded.call_kwargs)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(len(example_inputs))
        return gm.forward

    transformer = fam.denoiser

    def call(rows: int):
        transformer(torch.randn(rows, 16, 16), encoder_hidden_states=torch.randn(rows, 8, 32),
                    pooled_projections=torch.randn(rows, 32), timestep=torch.full((rows,), 0.5),
                    guidance=None, txt_ids=torch.zeros(8, 3), img_ids=torch.zeros(16, 3),
                    return_dict=False)

    compiled = CompiledBlocks([transformer], "cpu", backend=counting)
    try:
        with torch.inference_mode():
            call(2)
            seen = len(graphs)
            assert seen
            with compiled.eager():  # rows (or a dtype) the graphs have not seen: none built
                call(3)
            assert len(graphs) == seen and not compiled.bypassed
    finally:
        compiled.close()


def test_no_room_for_the_reference_skips_the_judgement_and_remembers_nothing(monkeypatch,
                                                                              tmp_path, caplog):
    from diffserve.executor.checks import float32

    monkeypatch.setattr(check_verdicts, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(float32, "host_available", lambda: 1)  # the host has no room
    ran = []
    monkeypatch.setattr(float32, "in_float32", lambda *a, **k: ran.append(a) or 1 / 0)
    config = ServerConfig(model="tiny-flux", dtype="bfloat16")
    rt = build_runtime(config, torch_threads=1)
    assert not ran and rt.mode == "step" and not rt.fallback
    assert "skipped" in caplog.text and "on the host" in caplog.text
    assert check_verdicts.recall(check_verdicts.key_of(rt, config)) is None
