"""The start-up check: the step engine against the plain pipeline on the loaded model. A family
that gets the model wrong falls back to request mode under --batching-mode auto and refuses to
start under step, naming the task and the difference; a correct one serves in step mode."""

from __future__ import annotations

import pytest

from diffserve.config import ServerConfig
from diffserve.executor import check_verdicts, self_check
from diffserve.executor.families.sd import StableDiffusion
from diffserve.executor.loading import UnsupportedMode
from diffserve.executor.runtime import build_runtime


@pytest.fixture(autouse=True)
def verdicts(tmp_path, monkeypatch):
    """An empty store of remembered verdicts: each test's checks run (the models stay in the
    session's cache)."""
    monkeypatch.setattr(check_verdicts, "cache_root", lambda: tmp_path)
    return tmp_path / "startup-checks"


def test_a_correct_family_passes_every_task_and_serves_in_step_mode():
    rt = build_runtime(ServerConfig(model="tiny-sd"), torch_threads=1)
    assert rt.mode == "step" and rt.info.batching_mode == "step"
    assert set(rt.pipelines) == {"generate", "image-to-image", "inpaint"}
    assert self_check.check(rt) is None


def test_a_verdict_is_remembered_for_the_same_model_and_code_only(monkeypatch, verdicts,
                                                                   tmp_path_factory):
    runs = []
    check = self_check.check
    monkeypatch.setattr(self_check, "check", lambda rt: runs.append(rt) or check(rt))
    first = build_runtime(ServerConfig(model="tiny-sd"), torch_threads=1)
    assert len(runs) == 1 and len(list(verdicts.glob("*.json"))) == 1
    again = build_runtime(ServerConfig(model="tiny-sd"), torch_threads=1)
    assert len(runs) == 1  # recalled, not run
    assert (again.mode, again.info.schedulers) == (first.mode, first.info.schedulers)
    # Another setting, or the same model's files touched: checked again.
    build_runtime(ServerConfig(model="tiny-sd", batching_mode="step"), torch_threads=1)
    assert len(runs) == 2
    import shutil

    from diffserve.models.registry import resolve_model

    copy = tmp_path_factory.mktemp("model") / "tiny-sd"
    shutil.copytree(resolve_model("tiny-sd"), copy)
    build_runtime(ServerConfig(model=str(copy)), torch_threads=1)
    assert len(runs) == 2  # the same files (paths, sizes and times kept by the copy)
    (copy / "scheduler" / "scheduler_config.json").touch()
    build_runtime(ServerConfig(model=str(copy)), torch_threads=1)
    assert len(runs) == 3


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
