"""The start-up checks, per task: the plain pipeline of each task on the loaded model (a task it
cannot run is not offered), then the step engine against it (a task it gets wrong runs in
request mode alone). A family that gets every task wrong falls back to request mode under
--batching-mode auto and refuses to start under step, naming each task and the difference; a
correct one serves every task in step mode."""

from __future__ import annotations

import pytest

from diffserve.config.flags import ServerConfig
from diffserve.executor.checks import verdicts as check_verdicts, startup as self_check
from diffserve.executor.families.sd.step import StableDiffusion
from diffserve.executor.families.known import UnsupportedMode
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
    assert rt.task_modes == dict.fromkeys(rt.pipelines, "step")
    assert self_check.check(rt) == self_check.TaskVerdicts()


def test_a_verdict_is_remembered_for_the_same_model_and_code_only(monkeypatch, verdicts,
                                                                   tmp_path_factory):
    runs = []
    check = self_check.check
    monkeypatch.setattr(self_check, "check", lambda rt, *rest: runs.append(rt) or check(rt, *rest))
    first = build_runtime(ServerConfig(model="tiny-sd"), torch_threads=1)
    assert len(runs) == 1 and len(list(verdicts.glob("*.json"))) == 1
    again = build_runtime(ServerConfig(model="tiny-sd"), torch_threads=1)
    assert len(runs) == 1  # recalled, not run
    assert (again.mode, again.info.schedulers) == (first.mode, first.info.schedulers)
    # Another setting, or the same model's files touched: checked again.
    build_runtime(ServerConfig(model="tiny-sd", batching_mode="step"), torch_threads=1)
    assert len(runs) == 2
    import shutil

    from diffserve.builders.registry import resolve_model

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
    assert rt.info.task_modes == dict.fromkeys(rt.pipelines, "request")
    assert ("serving generate in request mode: the start-up check found that on this model the "
            "step engine does not match the plain pipeline" in caplog.text)
    # The refusal names every task and its difference.
    with pytest.raises(UnsupportedMode, match=r"--batching-mode step: .*generate: the step "
                       r"engine's image differs from the plain pipeline's by \d+/255.*; "
                       r"image-to-image: .*; inpaint: "):
        build_runtime(ServerConfig(model="tiny-sd", batching_mode="step"), torch_threads=1)
    skipped = build_runtime(ServerConfig(model="tiny-sd", skip_startup_check=True), torch_threads=1)
    assert skipped.mode == "step"  # the operator's choice


def test_a_family_that_raises_falls_back_naming_the_error(monkeypatch):
    """A helper only generation uses raises: generation runs in request mode, named with the
    error; the edits keep the step engine, so --batching-mode step starts."""
    def broken(self, *args, **kwargs):
        raise RuntimeError("no such helper in this diffusers")

    monkeypatch.setattr(StableDiffusion, "noise_latents", broken)
    rt = build_runtime(ServerConfig(model="tiny-sd", batching_mode="step"), torch_threads=1)
    assert rt.info.task_modes == {"generate": "request", "image-to-image": "step",
                                  "inpaint": "step"}
    assert rt.fallback["generate"].startswith("the step engine failed: ")
    assert "no such helper" in rt.fallback["generate"]


def test_one_task_the_step_engine_gets_wrong_runs_alone_in_request_mode(monkeypatch, verdicts):
    """Inpainting's blend put back a little off: only inpainting differs, so it alone falls back;
    --batching-mode step still starts, and the verdict is remembered per task."""
    blend = StableDiffusion.blend
    monkeypatch.setattr(StableDiffusion, "blend", lambda self, *args: blend(self, *args) * 1.2)
    for requested in ("auto", "step"):
        rt = build_runtime(ServerConfig(model="tiny-sd", batching_mode=requested),
                           torch_threads=1)
        assert rt.mode == "step" and rt.info.batching_mode == "step"
        assert rt.info.task_modes == {"generate": "step", "image-to-image": "step",
                                      "inpaint": "request"}
        assert set(rt.fallback) == {"inpaint"} and not rt.unavailable
    monkeypatch.setattr(self_check, "check", lambda rt: pytest.fail("the verdict was remembered"))
    again = build_runtime(ServerConfig(model="tiny-sd"), torch_threads=1)
    assert again.info.task_modes["inpaint"] == "request"


def test_a_task_whose_plain_pipeline_cannot_run_is_not_offered(sd3_four_channels, caplog):
    """SD3's architecture with 4 latent channels: text-to-image and image-to-image run (and the
    step engine matches them), diffusers' SD3 inpainting refuses the transformer. In either mode
    the model serves the rest; inpainting is listed with the reason."""
    for requested, mode in (("step", "step"), ("request", "request")):
        rt = build_runtime(ServerConfig(model=str(sd3_four_channels), batching_mode=requested),
                           torch_threads=1)
        assert rt.info.tasks == ["generate", "image-to-image", "rollout"]
        assert set(rt.info.task_modes.values()) == {mode}
        assert "16 input channels or 33 input channels, not 4" in rt.info.unavailable_tasks["inpaint"]
    assert "task inpaint is not served: its plain pipeline failed" in caplog.text


def test_a_model_with_no_task_that_runs_does_not_start(monkeypatch):
    from diffserve.executor.request.runner import RequestRunner

    def broken(self, pairs):
        raise RuntimeError("this pipeline cannot run here")

    monkeypatch.setattr(RequestRunner, "_call", broken)
    with pytest.raises(RuntimeError, match=r"no task of this model can be served: generate: "
                       r"its plain pipeline failed: .*cannot run here; image-to-image: "):
        build_runtime(ServerConfig(model="tiny-sd", batching_mode="request"), torch_threads=1)


def test_the_verdict_key_names_the_card_the_group_the_kernel_and_the_control_models():
    """A verdict from one card, group shape, attention kernel or set of control models is not
    another's."""
    import dataclasses

    from diffserve.device import installed
    from diffserve.device.fake import FakeCuda

    config = ServerConfig(model="tiny-sd", skip_startup_check=True)
    rt = build_runtime(config, torch_threads=1)
    key = check_verdicts.key_of(rt, config)
    assert key == check_verdicts.key_of(rt, config)  # the same start: the same key
    on = dataclasses.replace(rt, loaded=dataclasses.replace(rt.loaded, device="cuda:0"))
    with installed(FakeCuda(name="NVIDIA H100 80GB HBM3", capability=(9, 0))) as card:
        h100, again = check_verdicts.key_of(on, config), check_verdicts.key_of(on, config)
        card.card = "Tesla T4"
        t4 = check_verdicts.key_of(on, config)
    assert h100 == again and len({key, h100, t4}) == 3
    grouped = ServerConfig(model="tiny-sd", skip_startup_check=True, ulysses_degree=2)
    kernel = dataclasses.replace(rt, speed={"attention": {"backend": "math"}})
    controlled = ServerConfig(model="tiny-sd", skip_startup_check=True,
                              controlnet=("c=tiny-sd-control",))
    others = {check_verdicts.key_of(rt, grouped), check_verdicts.key_of(kernel, config),
              check_verdicts.key_of(rt, controlled)}
    assert len(others) == 3 and key not in others
