"""--quantization: int8 weight-only denoisers serve (the start-up check holds, the weights
shrink, images stay close to the float ones), LoRA adapters apply per row on top, and what
cannot run here is refused at start with the reason."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diffserve.config.flags import ServerConfig
from diffserve.executor.model.quantization import QuantizationUnavailable, pipeline_config
from diffserve.executor.tensors import module_bytes
from diffserve.executor.runtime import build_runtime
from diffserve.builders.registry import resolve_model
from diffserve.wire.request import WorkItem
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
    from diffserve.builders.random.loras import write_lora

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


def test_int8_dynamic_quantizes_the_blocks_and_batches_exactly():
    """Activations scaled per row: a batch of three gives each image what it gives alone, and
    only the repeated blocks' layers are quantized (the embedders and the last layer are not)."""
    rt = build_runtime(ServerConfig(model="tiny-flux", quantization="int8-dynamic",
                                    skip_startup_check=True), torch_threads=1)
    denoiser = rt.family.denoisers[0]
    quantized = {name for name, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)
                 and type(m.weight).__name__ != "Parameter" and type(m.weight) is not torch.Tensor}
    assert quantized and all(".transformer_blocks." in f".{n}" or "single_transformer_blocks" in n
                             for n in quantized), quantized
    assert "proj_out" not in quantized and "x_embedder" not in quantized
    assert rt.speed["quantization"]["layers"] == len(quantized)
    requests = [make_request(request_id=f"q{i}", model="tiny-flux", prompt=f"prompt {i}", seed=i,
                             steps=3) for i in range(3)]
    engine = rt.step_engine()
    assert not engine.admit([WorkItem(r, 0, 1) for r in requests], [[]] * 3)
    together = {}
    while engine:
        together.update({o.item.request.request_id: o.images for o in engine.step().finished})
    for request in requests:
        assert max_diff(together[request.request_id], generate(rt, request)) <= 1


def test_fp8_needs_float8_tensor_cores_and_says_so():
    from diffserve.device import installed
    from diffserve.device.fake import FakeCuda
    from diffserve.executor.model.quantization import quantize_blocks

    with installed(FakeCuda(name="NVIDIA A100-SXM4-80GB", capability=(8, 0))):
        with pytest.raises(QuantizationUnavailable,
                           match=r"fp8 needs float8 tensor cores.*A100.*8\.0"):
            quantize_blocks("fp8", [torch.nn.Linear(4, 4)], "cuda:0")
    with pytest.raises(QuantizationUnavailable, match="CUDA GPU"):
        build_runtime(ServerConfig(model="tiny-flux", quantization="fp8", skip_startup_check=True))
