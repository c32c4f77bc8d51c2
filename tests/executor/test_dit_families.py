"""Qwen-Image, PixArt-Sigma and Sana in the step engine (and Qwen-Image in request mode): requests
that join at different steps, with different step counts, guidance, negative prompts and prompt
lengths, each equal to the plain pipeline run alone; Qwen-Image's prompts of different token
lengths share one forward, padded and masked, and its edits join the running set too."""

from __future__ import annotations

import pytest

from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.request.runner import RequestRunner
from diffserve.executor.step.engine import StepEngine
from diffserve.wire.request import Work, WorkItem
from helpers import make_request, run_plan as run
from diffserve.executor.checks.reference import max_diff, sample_image, solo

MODELS = ["tiny-qwen-image", "tiny-pixart-sigma", "tiny-sana"]


@pytest.fixture(scope="module", params=MODELS)
def setup(request):
    loaded = load_model(request.param, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe)
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    return request.param, loaded, pipelines, family


@pytest.fixture(scope="module")
def qwen():
    loaded = load_model("tiny-qwen-image", torch_threads=1)
    pipelines = task_pipelines(loaded.pipe)
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    return "tiny-qwen-image", loaded, pipelines, family


def test_staggered_mixed_requests_equal_their_solo_pipeline_runs(setup):
    model, loaded, pipelines, family = setup
    req = lambda rid, **kw: make_request(request_id=rid, model=model, **kw)  # noqa: E731
    plan = {
        0: [(req("a", prompt="a red circle", seed=1, steps=6, guidance=4.0), [])],
        2: [(req("b", prompt="a much longer prompt about a blue square standing on a wooden table",
                 seed=2, steps=4, guidance=3.0, negative_prompt="blurry", n=2), []),
            (req("c", prompt="x", seed=3, steps=5, guidance=1.0), [])],
        3: [(req("d", prompt="a green triangle", seed=4, steps=3, guidance=5.5,
                 negative_prompt="a very long negative prompt of many words indeed"), [])],
    }
    if "image-to-image" in pipelines:
        image, mask = sample_image(64)
        plan[3] += [(req("edit", task="image-to-image", prompt="make it green", seed=5, steps=6,
                         strength=0.6, guidance=4.0, negative_prompt="dark"), [image]),
                    (req("inpaint", task="inpaint", prompt="fill", seed=6, steps=5, strength=1.0,
                         guidance=2.0), [image, mask])]
    images = run(StepEngine(family), plan)
    for group in plan.values():
        for r, frames in group:
            assert max_diff(images[r.request_id], solo(loaded, pipelines, r, *frames)) <= 2, (
                model, r.request_id)


def test_qwen_image_prompts_of_different_lengths_share_one_forward(qwen):
    # (PixArt-Sigma and Sana pad every prompt to one fixed length.)
    model, loaded, pipelines, family = qwen
    lengths = []
    forward = family.forward

    def seen(latents, timesteps, cond, guidance, width, height):
        lengths.append(cond.prompt_embeds_mask.sum(dim=1).tolist())
        return forward(latents, timesteps, cond, guidance, width, height)

    family.forward = seen
    try:
        short = make_request(request_id="short", model=model, prompt="dot", seed=1, steps=3)
        long = make_request(request_id="long", model=model, seed=2, steps=3, guidance=4.0,
                            prompt="a long and winding description of a scene " * 3,
                            negative_prompt="grey")
        images = run(StepEngine(family), {0: [(short, []), (long, [])]})
    finally:
        family.forward = forward
    # One forward carries the short prompt, the long one and its negative, each its own length.
    assert len(lengths[0]) == 3 and len(set(lengths[0])) >= 2, lengths[0]
    for r in (short, long):
        assert max_diff(images[r.request_id], solo(loaded, pipelines, r)) <= 2


def test_qwen_image_guidance_is_true_cfg_with_a_negative_prompt_in_request_mode(qwen):
    model, loaded, pipelines, family = qwen
    runner = RequestRunner(loaded, pipelines, family)
    requests = [make_request(request_id="cfg", model=model, seed=1, guidance=4.0,
                             negative_prompt="noise"),
                make_request(request_id="plain", model=model, seed=2, guidance=4.0)]
    outcomes = runner.execute(Work(1, [WorkItem(r, 0, 1) for r in requests]), [[], []])
    for r, o in zip(requests, outcomes):
        assert o.error is None and max_diff(o.images, solo(loaded, pipelines, r)) <= 2, r.request_id
    assert family.uses_cfg(4.0, "noise") and not family.uses_cfg(4.0, "")
    assert not family.uses_cfg(1.0, "noise")


@pytest.mark.parametrize("scheduler", ["EulerDiscreteScheduler", "DDIMScheduler",
                                       "UniPCMultistepScheduler", "EulerAncestralDiscreteScheduler"])
def test_pixart_sigma_with_other_schedulers_of_its_config(scheduler):
    import diffusers

    loaded = load_model("tiny-pixart-sigma", torch_threads=1)
    loaded.pipe.scheduler = getattr(diffusers, scheduler).from_config(loaded.pipe.scheduler.config)
    pipelines = task_pipelines(loaded.pipe)
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    plan = {0: [(make_request(request_id="x", model="tiny-pixart-sigma", seed=7, steps=6), [])],
            2: [(make_request(request_id="y", model="tiny-pixart-sigma", seed=8, steps=4,
                              guidance=2.0, negative_prompt="ugly", n=2), [])]}
    images = run(StepEngine(family), plan)
    for group in plan.values():
        for r, _ in group:
            assert max_diff(images[r.request_id], solo(loaded, pipelines, r)) <= 2, r.request_id


def test_sana_with_a_flow_matching_euler_scheduler_in_the_step_engine():
    """The scheduler decides what it needs: flow-matching Euler has no ``scale_model_input``,
    and the step engine must not ask for it whatever the family usually runs with."""
    import diffusers

    loaded = load_model("tiny-sana", torch_threads=1)
    loaded.pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipelines = task_pipelines(loaded.pipe)
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    plan = {0: [(make_request(request_id="x", model="tiny-sana", seed=7, steps=5), [])],
            2: [(make_request(request_id="y", model="tiny-sana", seed=8, steps=3, guidance=2.0,
                              negative_prompt="ugly"), [])]}
    images = run(StepEngine(family), plan)
    for group in plan.values():
        for r, _ in group:
            assert max_diff(images[r.request_id], solo(loaded, pipelines, r)) <= 2, r.request_id
