"""The rows a step's FLOPs are counted for: a model with true CFG (Qwen-Image) runs two rows an
image only with a negative prompt, and what the accounting says agrees with what the counter
sees the denoiser run, with and without one."""

from __future__ import annotations

import pytest

from diffserve.config.flags import ServerConfig
from diffserve.executor.accel import flops
from diffserve.executor.runtime import build_runtime
from diffserve.wire.request import WorkItem
from helpers import make_request

STEPS = 2


def counted(rt, request) -> float:
    counter, _ = flops.counter_for(rt, rt.config)
    try:
        engine = rt.step_engine()
        assert not engine.admit([WorkItem(request, 0, request.n)], [[]])
        while engine:
            for outcome in engine.step().finished:
                assert outcome.error is None, outcome.error
        return counter.take()
    finally:
        counter.close()


@pytest.mark.parametrize("negative,rows", [("", 1), ("blurry", 2)])
def test_a_negative_prompt_doubles_qwen_images_rows(negative, rows):
    rt = build_runtime(ServerConfig(model="tiny-qwen-image", skip_startup_check=True),
                       torch_threads=1)
    info = rt.info
    assert flops.rows_per_image(info, 4.0, negative) == rows
    described = rt.speed["flops"]
    assert described["rows_per_image"] == 1
    assert described["rows_per_image_with_negative_prompt"] == 2
    request = make_request(2, model="tiny-qwen-image", steps=STEPS, guidance=4.0,
                           negative_prompt=negative, width=64, height=64)
    expected = STEPS * flops.step_flops(rt.flops, info, 2, 64, 64, guidance_scale=4.0,
                                        negative_prompt=negative)
    assert counted(rt, request) == pytest.approx(expected, rel=1e-9)


def test_a_model_with_ordinary_cfg_counts_two_rows_without_a_negative_prompt():
    rt = build_runtime(ServerConfig(model="tiny-sd", skip_startup_check=True), torch_threads=1)
    assert flops.rows_per_image(rt.info, 5.0, "") == 2
    assert flops.rows_per_image(rt.info, 1.0, "") == 1
    assert "rows_per_image_with_negative_prompt" not in rt.speed["flops"]
