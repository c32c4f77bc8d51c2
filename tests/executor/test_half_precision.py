"""Half precision keeps the step engine. In bfloat16 the start-up check judges each task by the
plain pipeline's own distance from a float32 run, so the tiny SD, Flux and Qwen-Image serve every
task in step mode; and each image the step engine makes with others (staggered, mixed steps and
tasks) is no further from the float32 image than the plain bfloat16 pipeline's, by the stated
rule (self_check.HALF_SLACK, HALF_MARGIN). The weights are back in bfloat16 after the check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffserve.config import ServerConfig
from diffserve.executor import check_verdicts, float32_reference, self_check
from diffserve.executor.runtime import build_runtime
from diffserve.protocol import Work, WorkItem
from helpers import make_request, run_plan
from reference import sample_image


@pytest.mark.parametrize("model", ["tiny-sd", "tiny-flux", "tiny-qwen-image"])
def test_bfloat16_serves_every_task_in_step_mode_within_its_own_error(model, monkeypatch,
                                                                      tmp_path):
    monkeypatch.setattr(check_verdicts, "cache_root", lambda: tmp_path)  # the check runs
    rt = build_runtime(ServerConfig(model=model, dtype="bfloat16", batching_mode="step"),
                       torch_threads=1)
    assert set(rt.info.task_modes.values()) == {"step"} and not rt.fallback, rt.fallback
    assert {p.dtype for p in rt.family.denoiser.parameters()} == {torch.bfloat16}
    image, mask = sample_image(64, seed=5)
    requests = [make_request(request_id=f"{task}-{i}", task=task, steps=3 + i, seed=10 + i,
                             strength=0.7 if task != "generate" else 1.0,
                             prompt=f"{task} number {i}", guidance=rt.info.default_guidance_scale)
                for task in ("generate", "image-to-image", "inpaint") for i in range(2)]
    inputs = {"generate": [], "image-to-image": [image], "inpaint": [image, mask]}
    # Staggered: half of them join at the second step.
    plan = {0: [(r, inputs[r.task]) for r in requests[::2]],
            1: [(r, inputs[r.task]) for r in requests[1::2]]}
    stepped = run_plan(rt.step_engine(), plan)

    def plain(rt, request):
        (outcome,) = rt.request_runner().execute(Work(0, [WorkItem(request, 0, 1)]),
                                                 [inputs[request.task]])
        return outcome

    half = {r.request_id: plain(rt, r).images for r in requests}
    exact = {rid: o.images for rid, o in float32_reference.run(rt, requests, plain).items()}
    for r in requests:
        off = lambda a: float(np.abs(a.astype(float) - exact[r.request_id].astype(float)).mean())  # noqa: E731
        allowed = off(half[r.request_id]) * (1 + self_check.HALF_SLACK) + self_check.HALF_MARGIN
        assert off(stepped[r.request_id]) <= allowed, (r.request_id, off(stepped[r.request_id]),
                                                       allowed)
