"""The step path waits for the device nowhere it need not: a step with ControlNet, LoRA (two
adapters at different scales, so that their rows are index tensors) and the step cache on, a
membership change among them, calls nothing that reads a device value on the host, nor sends a
host list up by a blocking copy (``torch.tensor(values, device=...)``). The one read left is
the step cache's decision: which rows hit decides the shapes of the rest of the forward, so it
is read once a forward where there is anything to compare (:data:`CACHE_READS`)."""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np
import pytest
import torch

from diffserve.config.flags import ServerConfig
from diffserve.executor.runtime import build_runtime
from diffserve.wire.request import Control, ImageRequest, WorkItem

READS = ("item", "tolist", "__bool__", "nonzero", "cpu", "__float__", "__int__", "numpy")
CACHE_READS = 1  # a forward: the step cache's decision


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    from diffserve.builders.random.loras import write_lora

    folder = tmp_path_factory.mktemp("loras")
    paths = {name: write_lora("tiny-sd", folder / name, rank=4, seed=i)
             for i, name in enumerate(("A", "B"))}
    return build_runtime(ServerConfig(
        model="tiny-sd", device="cpu", torch_threads=1, controlnet=("edges=tiny-sd-control",),
        lora_modules=tuple(f"{n}={p}" for n, p in paths.items()), step_cache="first-block",
        skip_startup_check=True))


def _request(rt, rid: str, **fields) -> ImageRequest:
    fields = {"num_inference_steps": 10, "guidance_scale": rt.info.default_guidance_scale,
              "prompt": f"a cat {rid}", "seed": 7, "cache_threshold": 0.5, **fields}
    return ImageRequest(rid, rt.info.name, 64, 64, **fields)


def _edges() -> np.ndarray:
    image = np.zeros((64, 64, 3), np.uint8)
    image[16:48, 16:48] = 255
    return image


class Reads:
    """Counts, by name, the calls that read a device value on the host or copy a host list up
    with a blocking copy, while :attr:`on`."""

    def __init__(self, monkeypatch) -> None:
        self.seen, self.on = Counter(), False
        for name in READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, original))
        original_tensor = torch.tensor

        def tensor(*args, **kwargs):
            if self.on and kwargs.get("device") is not None and _ours(sys._getframe(1)):
                self.seen["tensor(device=)"] += 1
            return original_tensor(*args, **kwargs)

        monkeypatch.setattr(torch, "tensor", tensor)

    def _counting(self, name, original):
        def counted(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            if self.on and _ours(caller):
                decision = caller.f_code.co_filename.endswith("cache_decision.py")
                self.seen["step cache" if decision else name] += 1
            return original(tensor, *args, **kwargs)
        return counted


def _ours(frame) -> bool:
    """Whether the call comes from diffserve's code. The scheduler's own step is diffusers'
    and left out: DDIM (tiny SD's) compares a timestep with 0 on the host, as diffusers' own
    pipelines do; the flow-matching schedulers keep their sigmas on the host."""
    return "/diffserve/" in frame.f_code.co_filename


def test_a_step_with_controls_adapters_and_the_step_cache_reads_nothing_else(rt, monkeypatch):
    edges = Control("edges", 0.8)
    first = [_request(rt, "a", controls=(edges,), loras=(("A", 0.7),)),
             _request(rt, "b", loras=(("B", 0.5), ("A", 0.3)), n=2),
             _request(rt, "c", controls=(Control("edges", 0.5),))]
    later = _request(rt, "d", loras=(("A", 1.0),), controls=(edges,))
    engine = rt.step_engine()
    assert not engine.admit([WorkItem(r, 0, r.n) for r in first],
                            [[_edges()] * len(r.controls) for r in first])
    for _ in range(2):  # warm: the first steps build the set's inputs and caches
        assert not engine.step().finished
    reads = Reads(monkeypatch)
    forwards = 0
    for step in range(4):
        if step == 1:  # a join: the set's inputs are built again
            assert not engine.admit([WorkItem(later, 0, 1)], [[_edges()]])
        reads.on = True
        out = engine.step()
        reads.on = False
        assert not out.finished
        forwards += 1
    engine.abandon("done")
    engine.close()
    cache = reads.seen.pop("step cache", 0)
    assert not reads.seen, dict(reads.seen)
    assert cache <= CACHE_READS * forwards
