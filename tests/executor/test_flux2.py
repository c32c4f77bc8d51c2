"""FLUX.2 [dev] and [klein] in the step engine, each image equal to the plain pipeline run alone
(within 2/255): requests joining at different steps with different step counts, guidance, seeds
and prompt lengths (klein: rows with and without classifier-free guidance in one forward), with
previews; instruction edits with one and two reference images, beside generations; rollouts;
LoRA adapters per row; edits in request mode."""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from diffserve.config.flags import ServerConfig
from diffserve.executor.lora.store import AdapterStore
from diffserve.executor.families.outputs import to_uint8
from diffserve.executor.runtime import build_runtime
from diffserve.executor.step.engine import StepEngine
from diffserve.builders.registry import resolve_model
from diffserve.wire.request import Work, WorkItem
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, sample_image, solo, with_adapters
from diffserve.builders.random.loras import write_lora

MODELS = ["tiny-flux2", "tiny-flux2-klein"]
TOLERANCE = 1e-4  # on final latents (std ~1); batching moves them by 1e-6 at most here


@pytest.fixture(scope="module", params=MODELS)
def rt(request):
    return build_runtime(ServerConfig(model=request.param, batching_mode="step"), torch_threads=1)


def req(rt, rid, **kw):
    return make_request(request_id=rid, model=rt.config.model, **kw)


def edit(rt, rid, refs, **kw):
    return req(rt, rid, task="edit", references=len(refs), **kw), list(refs)


def solo_edit(pipe, call_kwargs, request, references) -> np.ndarray:
    """The plain pipeline alone: ``image`` is one list of references for every row of a call
    (reference.solo passes one image a row), so each image of the request gets them all."""
    generators = [torch.Generator("cpu").manual_seed(request.seed_of(i)) for i in range(request.n)]
    with torch.inference_mode():
        return to_uint8(pipe(
            prompt=[request.prompt] * request.n, image=[Image.fromarray(r) for r in references],
            height=request.height, width=request.width, generator=generators,
            num_inference_steps=request.num_inference_steps, guidance_scale=request.guidance_scale,
            output_type="np", **call_kwargs).images)


@contextmanager
def vae_inputs(pipe):
    """Every batch of latents ``pipe`` hands its VAE to decode."""
    seen, decode = [], pipe.vae.decode

    def spy(z, *args, **kwargs):
        seen.append(z.clone())
        return decode(z, *args, **kwargs)

    pipe.vae.decode = spy
    try:
        yield seen
    finally:
        del pipe.vae.decode


@contextmanager
def engine_latents(family):
    """What the VAE decodes for each image the family decodes, by the image's bytes: pixels
    within 2/255 cannot tell a prompt or a reference apart on these tiny models (each moves the
    final latents by about 1e-3), so results are compared as latents too."""
    seen, decode = {}, family.decode

    def spy(latents, width, height, task):
        pixels = decode(latents, width, height, task)
        z = family.vae_latents(family.unpack(latents, width, height), task)
        seen.update({image.tobytes(): row for image, row in zip(pixels, z)})
        return pixels

    family.decode = spy
    try:
        yield seen
    finally:
        del family.decode


def expect(rt, made, by_image, request, refs=()):
    """The request's images equal the pipeline's alone: pixels within 2/255, latents 1e-4."""
    with vae_inputs(rt.loaded.pipe) as seen:
        expected = (solo_edit(rt.loaded.pipe, rt.loaded.call_kwargs, request, refs) if refs
                    else solo(rt.loaded, rt.pipelines, request))
    images = made[request.request_id].images
    assert max_diff(images, expected) <= 2, (rt.config.model, request.request_id)
    latents = torch.stack([by_image[image.tobytes()] for image in images])
    assert (latents - seen[-1]).abs().max() <= TOLERANCE, (rt.config.model, request.request_id)
    return latents


def drive(engine, plan):
    """Run ``plan`` ({step: [(request, frames)]}); (images, previews, step outputs)."""
    images, previews, outs, step = {}, {}, [], 0
    while step == 0 or engine:
        if step in plan:
            failed = engine.admit([WorkItem(r, 0, r.n) for r, _ in plan[step]],
                                  [frames for _, frames in plan[step]])
            assert not failed, [f.error for f in failed]
        out = engine.step()
        outs.append(out)
        for p in out.partials:
            previews.setdefault(p.request_id, []).append(p)
        for o in out.finished:
            assert o.error is None, o.error
            images[o.item.request.request_id] = o
        step += 1
    return images, previews, outs


def test_the_models_generate_edit_and_roll_out(rt):
    info = rt.info
    assert info.tasks == ["generate", "edit", "rollout"] and info.max_edit_images == 4
    assert not info.supports_negative_prompt
    klein = rt.config.model == "tiny-flux2-klein"
    assert info.guidance_rule == ("above_one" if klein else "never")
    assert rt.family.uses_cfg(4.0, "") == klein and not rt.family.uses_cfg(1.0, "")


def test_staggered_generations_equal_their_solo_pipeline_runs(rt):
    plan = {
        0: [(req(rt, "a", prompt="a red circle", seed=1, steps=6, guidance=4.0,
                 partial_images=2), [])],
        2: [(req(rt, "b", prompt="a much longer prompt about a blue square standing on a wooden "
                 "table", seed=2, steps=4, guidance=3.0, n=2), []),
            (req(rt, "c", prompt="x", seed=3, steps=5, guidance=1.0), [])],
        3: [(req(rt, "d", prompt="a green triangle", seed=4, steps=3, guidance=5.5), [])],
    }
    with engine_latents(rt.family) as by_image:
        images, previews, outs = drive(rt.step_engine(), plan)
    assert max(out.samples for out in outs) == 5  # a, b (2), c and d in one forward
    for group in plan.values():
        for r, _ in group:
            expect(rt, images, by_image, r)
    shown = previews["a"]
    assert [p.partial_index for p in shown] == [0, 1] and shown[0].image.shape == (64, 64, 3)
    assert max_diff(shown[1].image, images["a"].images[0]) > 0  # a preview, not the result


def test_edits_with_one_and_two_references_beside_a_generation(rt):
    picture, _ = sample_image(64)
    other = np.ascontiguousarray(picture[:, ::-1])
    third, _ = sample_image(64, seed=5)
    plan = {
        0: [(req(rt, "g", prompt="a red circle", seed=1, steps=4, guidance=3.5), []),
            edit(rt, "one", [picture], prompt="make it blue", seed=2, steps=4, guidance=3.0),
            edit(rt, "inverted", [255 - picture], prompt="make it blue", seed=2, steps=4,
                 guidance=3.0),
            edit(rt, "two", [picture, other], prompt="put the first into the second", seed=3,
                 steps=3, guidance=2.0, n=2)],
        1: [edit(rt, "one-b", [third], prompt="a much longer instruction: turn it into a cat",
                 seed=4, steps=5, guidance=1.0)],
    }
    with engine_latents(rt.family) as by_image:
        images, _, outs = drive(rt.step_engine(), plan)
    assert max(out.sets for out in outs) == 3  # generations, 1-reference and 2-reference edits
    latents = {r.request_id: expect(rt, images, by_image, r, refs)
               for group in plan.values() for r, refs in group}
    # Each row saw its own references: the same instruction, seed and forwards over the
    # inverted image end elsewhere.
    assert (latents["one"] - latents["inverted"]).abs().max() > 10 * TOLERANCE


def test_a_step_distilled_klein_runs_no_guidance_pass():
    rt = build_runtime(ServerConfig(model="tiny-flux2-klein"), torch_threads=1)
    rt.loaded.pipe.register_to_config(is_distilled=True)  # its pipeline then ignores guidance
    assert not rt.family.uses_cfg(4.0, "")
    r = req(rt, "d", prompt="a red circle", seed=1, steps=3, guidance=4.0)
    with engine_latents(rt.family) as by_image:
        images, _, _ = drive(rt.step_engine(), {0: [(r, [])]})
    expect(rt, images, by_image, r)


def test_request_mode_edits_one_request_a_call(rt):
    picture, _ = sample_image(64, seed=3)
    plan = [edit(rt, "r1", [picture, picture[::-1].copy()], prompt="swap", seed=7, steps=3, n=2),
            edit(rt, "r2", [picture], prompt="other", seed=9, steps=3)]
    outcomes = rt.request_runner().execute(Work(1, [WorkItem(r, 0, r.n) for r, _ in plan]),
                                           [refs for _, refs in plan])
    for (r, refs), o in zip(plan, outcomes):
        assert o.error is None, o.error
        assert max_diff(o.images, solo_edit(rt.loaded.pipe, rt.loaded.call_kwargs, r, refs)) <= 2


def velocity(pipe, prompt: str, x, t: float, guidance: float):
    """The model alone on one sample (latents as a rollout returns them, [C, h, w]): its guided
    velocity in the same layout, from the pipeline's own components."""
    grid = pipe._patchify_latents(x[None])
    tokens = pipe._pack_latents(grid)

    def run(text):
        embeds, text_ids = pipe.encode_prompt(text)
        return pipe.transformer(
            hidden_states=tokens, timestep=torch.tensor([t / 1000]), encoder_hidden_states=embeds,
            guidance=torch.tensor([guidance]) if pipe.transformer.config.guidance_embeds else None,
            txt_ids=text_ids, img_ids=pipe._prepare_latent_ids(grid), return_dict=False)[0]

    v = run(prompt)
    if not pipe.transformer.config.guidance_embeds and guidance > 1:  # klein: CFG against ""
        uncond = run("")
        v = uncond + guidance * (v - uncond)
    h, w = grid.shape[2:]
    return pipe._unpatchify_latents(v.reshape(1, h, w, -1).permute(0, 3, 1, 2))[0]


def test_rollouts_record_their_trajectory_and_log_probs(rt):
    returns = ("latents", "log_probs", "timesteps", "images", "prompt_embeds")
    rollout = lambda rid, noise, **kw: dataclasses.replace(  # noqa: E731
        req(rt, rid, task="rollout", prompt="a red circle", steps=4, guidance=3.0, **kw),
        noise_level=noise, returns=returns)
    sampled, plain = rollout("s", 0.8, seed=5, n=2), rollout("p", 0.0, seed=3)
    images, _, _ = drive(rt.step_engine(), {0: [(sampled, []), (plain, [])]})
    t = images["s"].tensors
    assert t["latents"].shape == (2, 5, 4, 8, 8) and t["latents"].dtype == np.float32
    assert t["log_probs"].shape == (2, 4) and np.isfinite(t["log_probs"]).all()
    assert t["timesteps"].shape == (4,) and t["sigmas"].shape == (5,) and t["sigmas"][-1] == 0
    assert t["images"].shape == (2, 64, 64, 3) and t["images"].dtype == np.uint8
    assert t["prompt_embeds"].shape == (512, 48)
    # Without noise the sampler is the pipeline's own Euler steps.
    generation = req(rt, "p", prompt="a red circle", seed=3, steps=4, guidance=3.0)
    assert max_diff(images["p"].images, solo(rt.loaded, rt.pipelines, generation)) <= 2
    # Each log-probability, recomputed from the returned latents with the model alone.
    sigmas, a, pipe = t["sigmas"].astype(np.float64), 0.8, rt.loaded.pipe
    with torch.inference_mode():
        for step in range(4):
            x = torch.from_numpy(t["latents"][1, step].copy())
            v = velocity(pipe, "a red circle", x, float(t["timesteps"][step]), 3.0).double()
            s_t, s_n = sigmas[step], sigmas[step + 1]
            d = s_n - s_t
            s = a * math.sqrt(s_t / (1 - (sigmas[1] if s_t >= 1 else s_t)))
            mean = (x.double() * (1 + s * s * d / (2 * s_t))
                    + v * (1 + s * s * (1 - s_t) / (2 * s_t)) * d)
            std = s * math.sqrt(-d)
            nxt = torch.from_numpy(t["latents"][1, step + 1].copy()).double()
            lp = (-((nxt - mean) ** 2) / (2 * std * std) - math.log(std)
                  - 0.5 * math.log(2 * math.pi)).mean().item()
            assert abs(lp - float(t["log_probs"][1, step])) <= 1e-3, (step, lp)


def test_lora_adapters_apply_per_row_in_one_forward(rt, tmp_path):
    model = rt.config.model
    rt = build_runtime(rt.config, torch_threads=1)  # its own copy: adapters stay loaded in it
    paths = {"A": write_lora(model, tmp_path / "A", rank=4, seed=1),
             "B": write_lora(model, tmp_path / "B", rank=8, seed=2)}
    store = AdapterStore(rt.loaded.pipe, max_resident=4, max_rank=64)
    reference = DiffusionPipeline.from_pretrained(resolve_model(model))
    reference.set_progress_bar_config(disable=True)
    for name, path in paths.items():
        store.add(name, path)
        reference.load_lora_weights(path, adapter_name=name)
    plan = [req(rt, "base", seed=1, steps=4),
            req(rt, "a", seed=2, steps=3, loras=(("A", 1.0),)),
            req(rt, "a+b", seed=3, steps=4, guidance=3.0, loras=(("A", 0.5), ("B", 0.8))),
            req(rt, "b", seed=4, steps=3, loras=(("B", 1.0),))]
    engine = StepEngine(rt.family, adapters=store)
    images, _, outs = drive(engine, {0: [(r, []) for r in plan[:2]],
                                     1: [(r, []) for r in plan[2:]]})
    assert max(out.samples for out in outs) == 4  # every stack in one forward

    def expected(r):
        pipe = with_adapters(reference, list(r.loras))
        return solo(dataclasses.replace(rt.loaded, pipe=pipe), {}, r)

    for r in plan:
        assert max_diff(images[r.request_id].images, expected(r)) <= 2, r.request_id
    plain = dataclasses.replace(plan[3], request_id="b-plain", loras=())
    assert max_diff(images["b"].images, expected(plain)) > 4  # the adapter changes images
