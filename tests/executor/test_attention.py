"""--attention-backend: a named kernel serves (through diffusers' dispatcher) or stops the start
naming what is missing; auto times the kernels that run here and keeps one whose output matches
native's."""

from __future__ import annotations

import pytest

from diffserve.config.flags import ConfigError, ServerConfig
from diffserve.executor.accel import attention
from diffserve.executor.checks.reference import max_diff
from diffserve.executor.runtime import build_runtime
from diffserve.wire.request import WorkItem
from helpers import make_request


def image(rt, seed: int = 3):
    engine = rt.step_engine()
    assert not engine.admit([WorkItem(make_request(request_id="a", model=rt.info.name,
                                                   prompt="a cat", seed=seed, steps=3), 0, 1)], [[]])
    while engine:
        for outcome in engine.step().finished:
            assert outcome.error is None, outcome.error
            return outcome.images


def test_a_named_kernel_serves_the_same_images_and_the_check_keeps_step_mode():
    native = build_runtime(ServerConfig(model="tiny-flux", skip_startup_check=True), torch_threads=1)
    math = build_runtime(ServerConfig(model="tiny-flux", attention_backend="math"), torch_threads=1)
    assert math.speed["attention"]["backend"] == "math" and math.mode == "step"
    assert not math.fallback  # the start-up check passed with it
    processors = [m.processor for m in math.family.denoisers[0].modules()
                  if hasattr(getattr(m, "processor", None), "_attention_backend")]
    assert processors and {str(p._attention_backend.value) for p in processors} == {"_native_math"}
    assert max_diff(image(math), image(native)) <= 1


@pytest.mark.parametrize("model,backend,why", [
    ("tiny-flux", "cudnn", "needs a CUDA GPU"),
    ("tiny-flux", "flash3", "needs a CUDA GPU"),
    ("tiny-sd", "math", "does not go through diffusers' attention dispatcher"),
    # Qwen-Image masks the padding of shorter prompts; torch's flash kernel takes no mask.
    ("tiny-qwen-image", "torch-flash", "prompts of different lengths failed: .*attn_mask"),
])
def test_a_kernel_that_cannot_run_stops_the_start_naming_the_flag(model, backend, why):
    with pytest.raises(ConfigError, match=f"--attention-backend {backend}: .*{why}"):
        build_runtime(ServerConfig(model=model, attention_backend=backend,
                                   skip_startup_check=True), torch_threads=1)


def test_auto_keeps_the_fastest_matching_kernel_and_says_why_others_were_left_out():
    rt = build_runtime(ServerConfig(model="tiny-flux", attention_backend="auto",
                                    skip_startup_check=True), torch_threads=1)
    chosen = rt.speed["attention"]
    assert chosen["backend"] == min(chosen["step_ms"], key=chosen["step_ms"].get)
    assert set(chosen["step_ms"]) | set(chosen["left_out"]) == set(attention.AUTO)
    assert "native" in chosen["step_ms"]
    assert all("CUDA GPU" in why for name, why in chosen["left_out"].items()
               if name in attention.NEEDS)


def test_a_missing_package_is_named():
    """flash-attn is not installed here: on a GPU the start would say so (diffusers' message)."""
    from diffserve.device import installed
    from diffserve.device.fake import FakeCuda

    with installed(FakeCuda(name="NVIDIA H100 80GB HBM3", capability=(9, 0))) as card:
        why = attention.unavailable("flash", "cuda:0", "bfloat16")
        assert why is not None and "flash-attn" in why
        assert "float16 or bfloat16" in attention.unavailable("flash", "cuda:0", "float32")
        card.cap = (7, 5)  # a T4: too old for flash, named
        assert "compute capability" in attention.unavailable("flash", "cuda:0", "bfloat16")
