"""diffserve calibrate: the fit and the bounds it suggests (in place), and the command on the
tiny model (a subprocess, as a user runs it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from diffserve.calibrate import Sample, fit, suggest


def samples(fixed: float, per_unit: float, peak_per_unit: int | None = None) -> list[Sample]:
    return [Sample(64, 64, n, n * 2.0, fixed + per_unit * n * 2.0,
                   peak_per_unit * n * 2 if peak_per_unit else None) for n in (1, 2, 4, 8)]


def test_the_fit_recovers_a_line_and_the_forward_bound_is_where_throughput_levels_off():
    assert fit(samples(0.010, 0.002)) == pytest.approx((0.010, 0.002))
    bounds = suggest(samples(0.010, 0.002), None, 1.0)
    # 90% of an endless batch's throughput at 9 x fixed / per unit = 45 units.
    assert bounds["max_batch_cost"] == 45 and bounds["max_running_cost"] == 90


def test_on_a_gpu_memory_caps_the_forward_and_the_rest_holds_running_latents():
    bounds = suggest(samples(0.010, 0.002, peak_per_unit=1 << 30), free_bytes=20 << 30,
                     latent_bytes_per_unit=1 << 20)
    assert bounds["max_batch_cost"] == 16  # 0.8 x 20 GiB / 1 GiB per unit
    assert bounds["max_running_cost"] >= bounds["max_batch_cost"]


def test_the_command_on_the_tiny_model():
    done = subprocess.run([sys.executable, "-m", "diffserve", "calibrate", "--model", "tiny-sd",
                           "--torch-threads", "1", "--steps", "2", "--batches", "1,2",
                           "--sides", "0.5,1", "--json"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert [(s["width"], s["image_count"]) for s in report["samples"]] == [(32, 1), (32, 2), (64, 1), (64, 2)]
    assert report["samples"][3]["cost"] == 4.0  # two 64x64 images with guidance
    assert report["suggested"]["max_batch_cost"] >= 1


def test_every_cuda_call_names_the_measured_device():
    """On a multi-GPU host calibrate measures cuda:1 (the device layer's fake GPU here: no GPU in
    CI): each synchronisation and memory statistic is asked of that device, never the current
    one."""
    import torch

    from diffserve.device import installed
    from diffserve.device.fake import FakeCuda
    from diffserve.device.stats import DeviceStats

    with installed(FakeCuda(count=2, allocated=100, free=7, total=9)) as fake:
        stats = DeviceStats("cuda:1")
        base = stats.start()
        fake.peak_bytes = 300
        stats.done()
        assert (base, stats.peak(base), stats.free()) == (100, 200, 7)
    assert {device for _, device in fake.asked} == {torch.device("cuda:1")}
    assert [name for name, _ in fake.asked] == ["synchronize", "reset_peak", "allocated",
                                               "synchronize", "peak_allocated", "free_total"]
    cpu = DeviceStats("cpu")
    assert cpu.start() is None and cpu.peak(None) is None and cpu.free() is None
