"""Models larger than the device, in process (diffserve.executor.memory.layout, memory_budget):
each offload mode and each placement serves the plain configuration's images in both batching
modes, with the offloading hooks running (their onloads counted; on a CPU both ends are the
host); tiled decoding equals diffusers' own tiles and stays within the stated PSNR of untiled
decoding; a quantized text encoder stays within its stated tolerance; a memory budget becomes a
cost bound, and one that holds no image stops the start."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from diffserve.config.flags import ConfigError, ServerConfig
from diffserve.executor.memory import layout as memory_layout
from diffserve.executor.model.loading import load_model
from diffserve.executor.runtime import build_runtime
from diffserve.wire.request import Work, WorkItem
from helpers import make_request, run_plan
from diffserve.executor.checks.reference import max_diff, solo

MODEL = "tiny-flux"
REQUESTS = [make_request(request_id=f"r{i}", model=MODEL, prompt=f"a red circle {i}", seed=i,
                         steps=3 + i, guidance=3.5) for i in range(2)]
TILED_PSNR_DB = 27.0  # shapes at 64x64 in 32-pixel tiles against untiled: 28.2 dB measured


def served(mode: str, **config) -> dict:
    rt = build_runtime(ServerConfig(model=MODEL, skip_startup_check=True, batching_mode=mode,
                                    **config), torch_threads=1)
    if mode == "step":
        return run_plan(rt.step_engine(), {0: [(REQUESTS[0], [])], 1: [(REQUESTS[1], [])]})
    outcomes = rt.request_runner().execute(Work(0, [WorkItem(r, 0, 1) for r in REQUESTS]), [[], []])
    return {o.item.request.request_id: o.images for o in outcomes}


@pytest.fixture(scope="module")
def plain() -> dict:
    return {mode: served(mode) for mode in ("step", "request")}


@pytest.fixture
def onloads(monkeypatch):
    from diffusers.hooks import group_offloading

    count = {"n": 0}
    real = group_offloading.ModuleGroup.onload_

    def counted(self, *args, **kwargs):
        count["n"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(group_offloading.ModuleGroup, "onload_", counted)
    return count


@pytest.mark.parametrize("mode", ["step", "request"])
@pytest.mark.parametrize("layout", [
    {"offload": "layer"},
    {"offload": "model"},
    {"offload": "layer", "offload_components": ("dit", "vae")},
    {"text_encoder_device": "cpu", "vae_device": "cpu"},
])
def test_offloading_and_placement_serve_the_plain_images(plain, onloads, mode, layout):
    got = served(mode, **layout)
    for r in REQUESTS:
        assert max_diff(got[r.request_id], plain[mode][r.request_id]) == 0, (layout, r.request_id)
    assert (onloads["n"] > 0) == ("offload" in layout), onloads  # the hooks ran (or none exist)


def test_tiles_equal_diffusers_own_and_stay_near_untiled(monkeypatch):
    loaded = load_model("shapes", torch_threads=1)
    r = make_request(model="shapes", width=64, height=64, steps=20, seed=3, prompt="a red circle")
    untiled = solo(loaded, {}, r)
    vae = loaded.pipe.vae
    vae.enable_tiling()  # diffusers' own tiles, at the size the flag sets
    vae.tile_sample_min_size, vae.tile_latent_min_size = 32, 32 // 2 ** (len(vae.config.block_out_channels) - 1)
    theirs = solo(loaded, {}, r)
    rt = build_runtime(ServerConfig(model="shapes", skip_startup_check=True, batching_mode="step",
                                    vae_tiling="on", vae_tile_size=32), torch_threads=1)
    ours = run_plan(rt.step_engine(), {0: [(r, [])]})[r.request_id]
    assert max_diff(ours, theirs) <= 2
    mse = float(((ours.astype(float) - untiled.astype(float)) ** 2).mean())
    assert 10 * math.log10(255 ** 2 / mse) >= TILED_PSNR_DB

    # auto: untiled below the threshold, tiled from it up
    auto = build_runtime(ServerConfig(model="shapes", skip_startup_check=True, batching_mode="step",
                                      vae_tiling="auto", vae_tile_size=32), torch_threads=1)
    assert np.array_equal(run_plan(auto.step_engine(), {0: [(r, [])]})[r.request_id], untiled)
    monkeypatch.setattr(memory_layout, "AUTO_TILE_PIXELS", 64 * 64)
    assert max_diff(run_plan(auto.step_engine(), {0: [(r, [])]})[r.request_id], theirs) <= 2


def test_a_quantized_text_encoder_serves_within_its_tolerance(plain):
    pytest.importorskip("torchao")
    got = served("step", text_encoder_quantization="int8-weight-only")
    for r in REQUESTS:
        assert max_diff(got[r.request_id], plain["step"][r.request_id]) <= 4  # 1 measured


def test_a_memory_budget_bounds_the_cost_and_one_too_small_stops_the_start():
    def info(budget, prompt_cache=1 << 20):
        return build_runtime(ServerConfig(model=MODEL, skip_startup_check=True, batching_mode="step",
                                          device_memory_bytes=budget,
                                          prompt_cache_bytes=prompt_cache), torch_threads=1).info

    unbounded, roomy, tight = info(0), info(200_000_000), info(20_000_000)
    assert unbounded.memory_budget_bytes == 0 and unbounded.max_running_cost == 16
    assert roomy.memory_cost_bound > tight.memory_cost_bound >= 1
    assert tight.max_running_cost == tight.max_batch_cost == tight.memory_cost_bound
    with pytest.raises(ConfigError, match="does not hold one image"):
        info(tight.memory_held_bytes)  # room for the weights, not for an image
    # What the prompt cache may hold is held: with its default budget, 200 MB holds no image.
    with pytest.raises(ConfigError, match=r"the prompt cache may hold 536.9 MB"):
        info(200_000_000, prompt_cache=512 << 20)
    with pytest.raises(ConfigError, match="--gpu-memory-utilization is a share of a GPU"):
        build_runtime(ServerConfig(model=MODEL, skip_startup_check=True, gpu_memory_utilization=0.5),
                      torch_threads=1)


MEASURE = """
import os, sys, threading, time
from diffserve.config.flags import ServerConfig
from diffserve.executor.memory.budget import unit_cost
from diffserve.executor.runtime import build_runtime
from diffserve.wire.request import ImageRequest, Work, WorkItem

rt = build_runtime(ServerConfig(model="tiny-sd", device="cpu", skip_startup_check=True,
                                batching_mode="request", device_memory_bytes=1 << 40,
                                prompt_cache_bytes=0), torch_threads=1)
info = rt.info
page = os.sysconf("SC_PAGE_SIZE")


def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page


def growth(n):
    # The resident memory's peak during a call of n images, above what it was as the call began.
    start, peak, done = resident(), [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], resident())
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    r = ImageRequest(f"m{n}", info.name, info.width, info.height, num_inference_steps=2,
                     guidance_scale=info.default_guidance_scale, prompt="a measure", n=n)
    (o,) = rt.request_runner().execute(Work(0, [WorkItem(r, 0, n)]), [[]])
    done.set()
    watcher.join()
    assert o.error is None, o.error
    return max(peak[0], resident()) - start


growth(1)
print(info.memory_per_cost_bytes * unit_cost(info) * 24, growth(24))
"""


def test_the_budget_holds_what_more_images_take_in_resident_memory():
    """In a process of its own, whose resident memory is what a CPU budget bounds: what the
    budget says 24 images take is at least what the process's resident memory grew by during
    their call (its CPU estimate counts every
    module's outputs, freed or not: docs/memory.md states by how much it is above)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    predicted, measured = map(float, done.stdout.split()[-2:])
    assert measured > 0 and predicted >= measured, (predicted, measured)


def test_the_step_cache_counts_each_images_image_stream_for_every_row():
    """Flux's double blocks return the text stream first: what the budget adds per image with a
    step cache is the image tokens' signal and tail (two tensors a row), not the text's."""
    plain = build_runtime(ServerConfig(model=MODEL, skip_startup_check=True, batching_mode="step",
                                       device_memory_bytes=1 << 40), torch_threads=1)
    cached = build_runtime(ServerConfig(model=MODEL, skip_startup_check=True, batching_mode="step",
                                        step_cache="first-block", device_memory_bytes=1 << 40),
                           torch_threads=1)
    transformer = cached.family.denoiser
    tokens = (cached.info.width // 16) * (cached.info.height // 16)  # 2x2-packed latent cells
    inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    added = (cached.info.memory_per_cost_bytes - plain.info.memory_per_cost_bytes) * 1.0
    assert added == pytest.approx(2 * tokens * inner * 4, rel=0.05), added


def test_a_measuring_call_that_fails_stops_the_start_saying_why(monkeypatch):
    from diffserve.executor.memory import budget

    rt = build_runtime(ServerConfig(model=MODEL, skip_startup_check=True, batching_mode="step"),
                       torch_threads=1)
    monkeypatch.setattr(rt.loaded.pipe.vae, "decode", _out_of_memory)
    with pytest.raises(ConfigError, match="could not be measured: a generation of 1 native "
                                          "image.*out of memory"):
        budget.measure(rt)


def _out_of_memory(*args, **kwargs):
    raise RuntimeError("CUDA error: out of memory (injected)")


@pytest.mark.parametrize("flags, message", [
    ({"offload": "layer", "compile": True}, "--offload layer with --compile"),
    ({"offload": "model", "step_cache": "first-block"}, "--offload model with --step-cache"),
    ({"offload": "layer", "lora_modules": ("a=/x",)}, "--offload layer with LoRA adapters"),
    ({"offload": "layer", "quantization": "int8-weight-only"}, "--offload layer with --quantization"),
    ({"offload_components": ("vae",)}, "--offload-components needs --offload"),
    ({"offload": "model", "offload_components": ("unet",)}, "'unet' is not one of dit"),
])
def test_bad_combinations_are_refused_naming_the_flags(flags, message):
    with pytest.raises(ConfigError, match=message):
        ServerConfig(**flags)
