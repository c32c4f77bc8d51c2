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
    """On a multi-GPU host calibrate measures cuda:1 (a stand-in here: no GPU in CI): each
    synchronisation and memory statistic is asked of that device, never the current one."""
    from types import SimpleNamespace

    import torch

    from diffserve.executor.model.device_stats import DeviceStats

    asked = []

    def call(name, value=0):
        return lambda *args: asked.append((name, args)) or value

    cuda = SimpleNamespace(synchronize=call("synchronize"),
                           reset_peak_memory_stats=call("reset_peak_memory_stats"),
                           memory_allocated=call("memory_allocated", 100),
                           max_memory_allocated=call("max_memory_allocated", 300),
                           mem_get_info=call("mem_get_info", (7, 9)))
    stats = DeviceStats(SimpleNamespace(cuda=cuda, device=torch.device), "cuda:1")
    base = stats.start()
    stats.done()
    assert (base, stats.peak(base), stats.free()) == (100, 200, 7)
    assert {args for _, args in asked} == {(torch.device("cuda:1"),)}
    assert [name for name, _ in asked] == ["synchronize", "reset_peak_memory_stats",
                                          "memory_allocated", "synchronize",
                                          "max_memory_allocated", "mem_get_info"]
    cpu = DeviceStats(torch, "cpu")
    assert cpu.start() is None and cpu.peak(None) is None and cpu.free() is None
