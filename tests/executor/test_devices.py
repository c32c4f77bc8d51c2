"""Device and dtype resolution: pure functions of the flags, the GPUs and the model's family."""

from __future__ import annotations

import pytest

from diffserve.device import installed
from diffserve.device.choice import pick_device
from diffserve.device.fake import FakeCuda
from diffserve.executor.model.dtypes import resolve_dtype
from diffserve.executor.families.known import FAMILIES, family_for


def test_cuda_and_auto_spread_executors_over_the_visible_gpus():
    assert [pick_device("cuda", i, gpus=2) for i in range(4)] == ["cuda:0", "cuda:1"] * 2
    assert [pick_device("auto", i, gpus=3) for i in range(4)] == ["cuda:0", "cuda:1", "cuda:2",
                                                                  "cuda:0"]
    assert pick_device("auto", 5, gpus=0) == "cpu"
    assert pick_device("cuda:1", 0, gpus=2) == "cuda:1" and pick_device("cpu", 3, gpus=2) == "cpu"
    with pytest.raises(ValueError, match="--device cuda: no CUDA GPU"):
        pick_device("cuda", 0, gpus=0)


def test_auto_dtype_is_the_familys_on_a_gpu_and_float32_on_the_cpu():
    published = {family.name: family.published_dtype for family in FAMILIES}
    assert published["stable-diffusion"] == published["stable-diffusion-xl"] == "float16"
    assert {name for name, dtype in published.items() if dtype == "float16"} == {
        "stable-diffusion", "stable-diffusion-xl"}
    flux = family_for("FluxPipeline").published_dtype
    assert resolve_dtype("auto", "cuda:0", flux, bf16_supported=True) == "bfloat16"
    assert resolve_dtype("auto", "cuda:0", flux, bf16_supported=False) == "float16"
    assert resolve_dtype("auto", "cuda:0", "float16", bf16_supported=True) == "float16"
    assert resolve_dtype("auto", "cuda:0", None, bf16_supported=True) == "bfloat16"
    assert resolve_dtype("auto", "cpu", flux) == "float32"
    assert resolve_dtype("float16", "cuda:0", flux) == "float16"  # the operator's choice


def test_auto_dtype_asks_for_native_bfloat16_only(monkeypatch):
    """A T4 or V100 answers True when emulation counts: auto must pick float16 there."""
    import torch

    def emulating_card(including_emulation: bool = True) -> bool:
        return including_emulation  # bfloat16 only by emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", emulating_card)  # the CUDA kind asks so
    flux = family_for("FluxPipeline").published_dtype
    assert resolve_dtype("auto", "cuda:0", flux) == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", "cuda:0", flux) == "bfloat16"


def test_auto_dtype_on_a_card_that_emulates_bfloat16_is_float16():
    """The same decision through the device layer's fake GPU: a T4 (bfloat16 by emulation only)
    gets float16, an H100 the family's bfloat16; no GPU visible, auto is the CPU's float32."""
    flux = family_for("FluxPipeline").published_dtype
    with installed(FakeCuda(name="Tesla T4", capability=(7, 5), bf16_native=False)):
        device = pick_device("auto", 0)
        assert device == "cuda:0" and resolve_dtype("auto", device, flux) == "float16"
    with installed(FakeCuda(count=2, name="NVIDIA H100 80GB HBM3")):
        device = pick_device("auto", 3)
        assert device == "cuda:1" and resolve_dtype("auto", device, flux) == "bfloat16"
    with installed(FakeCuda(count=0)):
        assert pick_device("auto", 0) == "cpu"
        with pytest.raises(ValueError, match="no CUDA GPU"):
            pick_device("cuda", 0)
