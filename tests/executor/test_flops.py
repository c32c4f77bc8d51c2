"""Model FLOPs: the quadratic fitted from torch's FLOP counter at three sizes predicts a fourth
size's count exactly, for a packed transformer, a UNet, a padding transformer (Z-Image) and a
video model; the counter's hook reads tokens and rows from every input layout; the utilisation's
window; the peak table."""

from __future__ import annotations

import pytest

from diffserve.config.flags import ServerConfig
from diffserve.executor.accel import flops
from diffserve.executor.runtime import build_runtime


@pytest.mark.parametrize("model,check", [("tiny-flux", (5, 4)), ("tiny-sd", (5, 4)),
                                         ("tiny-z-image", (4, 4)), ("tiny-wan", (2, 1))])
def test_the_fit_predicts_another_sizes_count(model, check):
    rt = build_runtime(ServerConfig(model=model, skip_startup_check=True), torch_threads=1)
    fitted = flops.fit(rt)
    assert fitted is not None and fitted.c > 0  # attention: quadratic in the tokens
    info = rt.info
    unit = 8 * info.spatial_stride
    frames = info.frame_stride + 1 if info.num_frames else 0
    width, height = check[0] * unit, check[1] * unit
    tokens, rows, counted = flops.count_forward(rt, width, height, frames)
    assert tokens == flops.tokens_of(fitted, info, width, height, frames)
    assert rows * fitted.per_row(tokens) == pytest.approx(counted, rel=1e-9)
    assert rt.flops == fitted  # what the runtime keeps (fitted, or remembered from a fit)
    described = rt.speed["flops"]
    assert described["per_step_native"] == pytest.approx(described["rows_per_image"] * fitted.per_row(
        flops.tokens_of(fitted, info, info.width, info.height, info.num_frames)))


def test_tokens_and_rows_read_every_input_layout():
    import torch

    assert flops.tokens_and_rows((), {"hidden_states": torch.zeros(3, 256, 64)}) == (256, 3)
    assert flops.tokens_and_rows((torch.zeros(2, 4, 32, 24),), {}) == (768, 2)  # a UNet's sample
    assert flops.tokens_and_rows((), {"hidden_states": torch.zeros(2, 16, 3, 8, 8)}) == (192, 2)
    assert flops.tokens_and_rows(([torch.zeros(16, 1, 8, 8)] * 3,), {}) == (64, 3)  # Z-Image
    assert flops.tokens_and_rows((), {"hidden_states": torch.zeros(4)}) is None


def test_the_utilization_is_the_windows_flops_over_its_device_time():
    u = flops.Utilization(peak=100.0, window_s=10.0)
    assert u.add(0.0, 0.0) is None  # nothing timed yet
    assert u.add(400.0, 5.0) == pytest.approx(0.8)  # 80 FLOP/s of 100
    assert u.add(200.0, 5.0) == pytest.approx(0.6)
    assert u.add(100.0, 5.0) == pytest.approx(0.3)  # the first step left the window


def test_the_peak_comes_from_the_flag_or_the_table():
    from diffserve.device import installed
    from diffserve.device.fake import FakeCuda

    assert flops.peak_flops("cpu", "float32", "none", 0.0) == 0.0  # unknown: no utilisation
    assert flops.peak_flops("cpu", "float32", "none", 2.5) == 2.5e12
    with installed(FakeCuda(name="NVIDIA H100 80GB HBM3")) as card:
        assert flops.peak_flops("cuda:0", "bfloat16", "none", 0.0) == pytest.approx(989.4e12)
        assert flops.peak_flops("cuda:0", "bfloat16", "fp8", 0.0) == pytest.approx(1978.9e12)
        card.card = "NVIDIA H100 PCIe"
        assert flops.peak_flops("cuda:0", "float16", "none", 0.0) == pytest.approx(756.5e12)
        card.card = "NVIDIA L40S"
        assert flops.peak_flops("cuda:0", "bfloat16", "none", 0.0) == pytest.approx(362.1e12)
        card.card = "Tesla T4"
        assert flops.peak_flops("cuda:0", "float16", "none", 0.0) == 0.0
