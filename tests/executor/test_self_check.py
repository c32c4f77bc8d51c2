"""The start-up check: the step engine against the plain pipeline on the loaded model. A family
that gets the model wrong falls back to request mode under --batching-mode auto and refuses to
start under step, naming the task and the difference; a correct one serves in step mode."""

from __future__ import annotations

import pytest

from diffserve.config import ServerConfig
from diffserve.executor import self_check
from diffserve.executor.families.sd import StableDiffusion
from diffserve.executor.loading import UnsupportedMode
from diffserve.executor.runtime import build_runtime


def test_a_correct_family_passes_every_task_and_serves_in_step_mode():
    rt = build_runtime(ServerConfig(model="tiny-sd"), torch_threads=1)
    assert rt.mode == "step" and rt.info.batching_mode == "step"
    assert set(rt.pipelines) == {"generate", "image-to-image", "inpaint"}
    assert self_check.check(rt) is None


def test_a_broken_family_falls_back_in_auto_and_refuses_in_step(monkeypatch, caplog):
    guide = StableDiffusion.guide
    # Guidance a little too strong: every image with CFG comes out wrong, not broken.
    monkeypatch.setattr(StableDiffusion, "guide",
                        lambda self, uncond, cond, scale: guide(self, uncond, cond, scale * 1.5))
    rt = build_runtime(ServerConfig(model="tiny-sd"), torch_threads=1)
    assert rt.mode == "request" and rt.info.batching_mode == "request"
    assert "the step engine does not match the plain pipeline (generate:" in caplog.text
    with pytest.raises(UnsupportedMode, match=r"--batching-mode step: .*generate: the step "
                       r"engine's image differs from the plain pipeline's by \d+/255"):
        build_runtime(ServerConfig(model="tiny-sd", batching_mode="step"), torch_threads=1)
    skipped = build_runtime(ServerConfig(model="tiny-sd", skip_startup_check=True), torch_threads=1)
    assert skipped.mode == "step"  # the operator's choice


def test_a_family_that_raises_falls_back_naming_the_error(monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("no such helper in this diffusers")

    monkeypatch.setattr(StableDiffusion, "noise_latents", broken)
    with pytest.raises(UnsupportedMode, match="the step engine failed: .*no such helper"):
        build_runtime(ServerConfig(model="tiny-sd", batching_mode="step"), torch_threads=1)
