"""--quantization: int8 weight-only denoisers serve (the start-up check holds, the weights
shrink, images stay close to the float ones), LoRA adapters apply per row on top, and what
cannot run here is refused at start with the reason."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diffserve.config import ServerConfig
from diffserve.executor.model.quantization import QuantizationUnavailable, pipeline_config
from diffserve.executor.tensors import module_bytes
from diffserve.executor.runtime import build_runtime
from diffserve.models.registry import resolve_model
from diffserve.work import WorkItem
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, solo, with_adapters

pytest.importorskip("torchao")

INT8 = "int8-weight-only"


def generate(rt, request):
    engine = rt.step_engine()
    assert not engine.admit([WorkItem(request, 0, request.n)], [[]])
    finished = []
    while engine:
        finished += engine.step().finished
    (outcome,) = finished
    assert outcome.error is None, outcome.error
    return outcome.images


@pytest.mark.parametrize("model", ["tiny-sd", "tiny-flux"])
def test_int8_weight_only_serves_smaller_and_close_to_float(model):
    # The start-up check runs: the step engine matches the plain pipeline on the int8 model.
    rt = build_runtime(ServerConfig(model=model, quantization=INT8, batching_mode="step"),
                       torch_threads=1)
    plain = build_runtime(ServerConfig(model=model, batching_mode="step",
                                       skip_startup_check=True), torch_threads=1)
    logical, stored = module_bytes(rt.family.denoiser)
    assert module_bytes(plain.family.denoiser) == (logical, logical)
    assert stored < 0.85 * logical  # linear weights at a quarter; convolutions stay float
    request = make_request(request_id="q", model=model, seed=3, steps=6)
    quantized, float32 = generate(rt, request), generate(plain, request)
    assert max_diff(quantized, solo(rt.loaded, rt.pipelines, request)) <= 2
    error = np.abs(quantized.astype(float) - float32.astype(float))
    assert error.mean() < 4  # of 255: int8 weights move pixels a little, not the image


def test_lora_adapters_apply_per_row_over_int8_weights(tmp_path):
    from diffserve.models.random.loras import write_lora

    paths = {"A": write_lora("tiny-sd", tmp_path / "A", rank=4, seed=1)}
    rt = build_runtime(ServerConfig(model="tiny-sd", quantization=INT8, batching_mode="step",
                                    lora_modules=tuple(f"{n}={p}" for n, p in paths.items()),
                                    skip_startup_check=True), torch_threads=1)
    request = make_request(request_id="l", seed=4, steps=4, loras=(("A", 0.7),))
    served = generate(rt, request)
    # The reference: the same int8 pipeline with the adapter through PEFT.
    from diffusers import DiffusionPipeline

    path = resolve_model("tiny-sd")
    reference = DiffusionPipeline.from_pretrained(path, dtype=torch.float32,
                                                  quantization_config=pipeline_config(INT8, path, "cpu"))
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(paths["A"], adapter_name="A")
    expected = solo(SimpleNamespace(pipe=with_adapters(reference, [("A", 0.7)]), call_kwargs={}),
                    {}, request)
    assert max_diff(served, expected) <= 2


def test_fp8_needs_a_gpu_and_says_so():
    with pytest.raises(QuantizationUnavailable, match="CUDA GPU"):
        pipeline_config("fp8-weight-only", resolve_model("tiny-sd"), "cpu")


def test_without_torchao_the_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # import fails
    with pytest.raises(QuantizationUnavailable, match=r"diffserve\[quantization\]"):
        pipeline_config(INT8, resolve_model("tiny-sd"), "cpu")
