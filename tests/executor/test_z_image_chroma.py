"""Z-Image and Chroma in the step engine: requests that join at different steps, with different
step counts, guidance (on and off by each family's rule), negative prompts, seeds and prompt
lengths, each equal to the plain pipeline run alone (Z-Image's image-to-image and inpainting too);
previews; rollouts, whose log-probabilities a trainer recomputes with the model alone; LoRA
adapters on the transformer, per row; and the embedded builds, reloaded offline."""

from __future__ import annotations

import dataclasses
import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from diffserve.executor.lora.store import AdapterStore
from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.step.rollout import log_prob
from diffserve.executor.step.engine import StepEngine
from diffserve.builders.registry import resolve_model, serving_defaults
from diffserve.builders.embedded import EMBEDDED
from helpers import make_request, run_plan
from diffserve.executor.checks.reference import max_diff, sample_image, solo, with_adapters
from diffserve.builders.random.loras import write_lora

# Each family's largest guidance scale without a negative pass, and a small one with it.
NO_CFG = {"tiny-z-image": 0.0, "tiny-chroma": 1.0}
SMALL_CFG = {"tiny-z-image": 0.5, "tiny-chroma": 1.5}


@pytest.fixture(scope="module", params=sorted(NO_CFG))
def setup(request):
    loaded = load_model(request.param, torch_threads=1)
    cls = family_for(loaded.pipeline_class)
    pipelines = task_pipelines(loaded.pipe, cls)
    return SimpleNamespace(model=request.param, loaded=loaded, pipelines=pipelines,
                           family=cls(loaded.pipe, pipelines, loaded.call_kwargs))


def run(engine, plan) -> tuple[dict, list]:
    """``run_plan`` keeping every step's output: each request's outcome (its rollout tensors
    too) by request id, and the previews."""
    outputs, step = [], engine.step
    engine.step = lambda: outputs.append(step()) or outputs[-1]
    run_plan(engine, plan)
    return ({o.item.request.request_id: o for out in outputs for o in out.finished},
            [p for out in outputs for p in out.partials])


def test_staggered_mixed_requests_equal_their_solo_pipeline_runs(setup):
    req = lambda rid, **kw: make_request(request_id=rid, model=setup.model, **kw)  # noqa: E731
    plan = {
        0: [(req("a", prompt="a red circle", seed=1, steps=6, guidance=4.0), [])],
        2: [(req("b", prompt="a much longer prompt about a blue square standing on a wooden table",
                 seed=2, steps=4, guidance=3.0, negative_prompt="blurry", n=2, partial_images=1),
             []),
            (req("c", prompt="x", seed=3, steps=5, guidance=NO_CFG[setup.model]), [])],
        3: [(req("d", prompt="a green triangle", seed=4, steps=3, guidance=SMALL_CFG[setup.model],
                 negative_prompt="a very long negative prompt of many words indeed"), [])],
    }
    if "image-to-image" in setup.pipelines:
        image, mask = sample_image(64)
        plan[3] += [(req("edit", task="image-to-image", prompt="make it green", seed=5, steps=6,
                         strength=0.6, guidance=4.0, negative_prompt="dark"), [image]),
                    (req("inpaint", task="inpaint", prompt="fill", seed=6, steps=5, strength=1.0,
                         guidance=2.0), [image, mask])]
    done, partials = run(StepEngine(setup.family), plan)
    for group in plan.values():
        for r, frames in group:
            expected = solo(setup.loaded, setup.pipelines, r, *frames)
            assert max_diff(done[r.request_id].images, expected) <= 2, (setup.model, r.request_id)
    assert sorted((p.request_id, p.index) for p in partials) == [("b", 0), ("b", 1)]
    assert all(p.image.shape == (64, 64, 3) for p in partials)


def test_prompts_of_different_lengths_share_one_forward(setup):
    family, seen = setup.family, []
    forward = family.forward

    def spy(latents, timesteps, cond, guidance, width, height):
        # Z-Image: each row's caption length; Chroma: each row's kept text tokens.
        lengths = getattr(cond, "prompt_lengths", None)  # on the host (a tuple)
        seen.append(list(lengths) if lengths is not None else cond.attention_mask.sum(1).tolist())
        return forward(latents, timesteps, cond, guidance, width, height)

    family.forward = spy
    try:
        short = make_request(request_id="short", model=setup.model, prompt="dot", seed=1,
                             steps=3, guidance=NO_CFG[setup.model])
        long = make_request(request_id="long", model=setup.model, seed=2, steps=3, guidance=4.0,
                            prompt="a long and winding description of a scene " * 2,
                            negative_prompt="grey")
        done, _ = run(StepEngine(family), {0: [(short, []), (long, [])]})
    finally:
        family.forward = forward
    assert len(seen[0]) == 3 and len(set(seen[0])) == 3, seen[0]  # short, grey, long
    for r in (short, long):
        assert max_diff(done[r.request_id].images, solo(setup.loaded, setup.pipelines, r)) <= 2


def velocity(setup, x, t: float, guidance: float, prompt: str):
    """The guided velocity of one sample (latents [C, h, w]) from the pipeline's components
    alone, as a trainer recomputes it (both families guide here: the default negative "")."""
    pipe = setup.loaded.pipe
    with torch.inference_mode():
        if setup.model == "tiny-z-image":
            positive, negative = pipe.encode_prompt([prompt], do_classifier_free_guidance=True)
            rows = pipe.transformer([x[:, None], x[:, None]], torch.full((2,), (1000 - t) / 1000),
                                    positive + negative, return_dict=False)[0]
            cond, uncond = rows[0].float()[:, 0], rows[1].float()[:, 0]
            return -(cond + guidance * (cond - uncond))  # the transformer's sign is flipped
        embeds, text_ids, mask, negative, _, negative_mask = pipe.encode_prompt(
            [prompt], do_classifier_free_guidance=True, **setup.loaded.call_kwargs)
        c, h, w = x.shape
        packed = pipe._pack_latents(x[None], 1, c, h, w)
        image_ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)

        def predict(text, text_mask):
            full = pipe._prepare_attention_mask(1, packed.shape[1], packed.dtype, text_mask)
            return pipe.transformer(hidden_states=packed, timestep=torch.tensor([t / 1000]),
                                    encoder_hidden_states=text, txt_ids=text_ids,
                                    img_ids=image_ids, attention_mask=full, return_dict=False)[0]

        cond, uncond = predict(embeds, mask), predict(negative, negative_mask)
        guided = uncond + guidance * (cond - uncond)
        return pipe._unpack_latents(guided, 8 * h, 8 * w, pipe.vae_scale_factor)[0]


def test_rollouts_return_their_trajectory_and_on_policy_log_probs(setup):
    everything = ("latents", "log_probs", "timesteps", "images", "prompt_embeds")
    base = make_request(request_id="sampled", model=setup.model, task="rollout",
                        prompt="a red circle", seed=9, n=2, steps=4, guidance=3.0)
    sampled = dataclasses.replace(base, noise_level=0.8, returns=everything)
    plain = dataclasses.replace(base, request_id="plain", returns=("images",))
    done, _ = run(StepEngine(setup.family), {0: [(sampled, [])], 1: [(plain, [])]})
    t = done["sampled"].tensors
    channels = 16 if setup.model == "tiny-z-image" else 4
    assert t["latents"].shape == (2, 5, channels, 8, 8) and t["latents"].dtype == np.float32
    assert t["log_probs"].shape == (2, 4) and np.isfinite(t["log_probs"]).all()
    assert t["timesteps"].shape == (4,) and t["sigmas"].shape == (5,) and t["sigmas"][-1] == 0
    assert t["images"].shape == (2, 64, 64, 3) and t["prompt_embeds"].ndim == 2
    # Without noise the sampler is the pipeline's own Euler step.
    generation = dataclasses.replace(base, task="generate")
    assert max_diff(done["plain"].images, solo(setup.loaded, setup.pipelines, generation)) <= 2
    assert max_diff(done["sampled"].images, done["plain"].images) > 2
    # The sampler's Gaussian step around the velocity the model gives alone.
    sigmas, a = t["sigmas"].astype(np.float64), 0.8
    for i, step in itertools.product(range(2), range(4)):
        x = torch.from_numpy(t["latents"][i, step].copy())
        v = velocity(setup, x, float(t["timesteps"][step]), 3.0, "a red circle").double()
        s_t, d = sigmas[step], sigmas[step + 1] - sigmas[step]
        s = a * math.sqrt(s_t / (1 - (sigmas[1] if s_t >= 1 else s_t)))
        mean = (x.double() * (1 + s * s * d / (2 * s_t))
                + v * (1 + s * s * (1 - s_t) / (2 * s_t)) * d)
        following = torch.from_numpy(t["latents"][i, step + 1].copy()).double()
        lp = log_prob(following[None], mean[None], s * math.sqrt(-d)).item()
        assert abs(lp - float(t["log_probs"][i, step])) <= 1e-3, (i, step, lp)


def test_each_family_guides_by_its_own_pipelines_rule(setup):
    family, cls = setup.family, type(setup.family)
    if setup.model == "tiny-z-image":
        # Guidance counts from 0: any positive scale runs the negative pass, pos + g (pos - neg).
        assert not cls.uses_cfg(0.0, "ugly") and cls.uses_cfg(0.5, "") and cls.uses_cfg(1.0, "")
        assert torch.equal(family.guide(torch.zeros(1, 2), torch.ones(1, 2), 0.5),
                           torch.full((1, 2), 1.5))
    else:
        assert not cls.uses_cfg(1.0, "ugly") and cls.uses_cfg(1.5, "")
        assert torch.equal(family.guide(torch.zeros(1, 2), torch.ones(1, 2), 3.0),
                           torch.full((1, 2), 3.0))


def test_z_image_caps_the_guided_norm_as_its_pipeline_does():
    loaded = load_model("tiny-z-image", torch_threads=1)
    capped = dataclasses.replace(loaded, call_kwargs={**loaded.call_kwargs,
                                                      "cfg_normalization": 1.05})
    pipelines = task_pipelines(loaded.pipe, family_for(loaded.pipeline_class))
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, capped.call_kwargs)
    requests = [make_request(request_id=f"r{i}", model="tiny-z-image", seed=i, steps=4,
                             guidance=6.0, negative_prompt="dull") for i in range(2)]
    done, _ = run(StepEngine(family), {0: [(requests[0], [])], 1: [(requests[1], [])]})
    for r in requests:
        assert max_diff(done[r.request_id].images, solo(capped, pipelines, r)) <= 2
        assert max_diff(done[r.request_id].images, solo(loaded, pipelines, r)) > 2  # it bites
    with pytest.raises(ValueError, match="cfg_truncation"):
        type(family)(loaded.pipe, pipelines, {"cfg_truncation": 0.5})


@pytest.mark.parametrize("model", sorted(NO_CFG))
def test_transformer_adapters_apply_per_row_exactly(model, tmp_path):
    loaded = load_model(model, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe, family_for(loaded.pipeline_class))
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    store = AdapterStore(loaded.pipe, max_resident=2, max_rank=16)
    reference = DiffusionPipeline.from_pretrained(resolve_model(model))
    reference.set_progress_bar_config(disable=True)
    # Both pipelines' LoRA loaders take the transformer (Chroma's is Flux's, whose text-encoder
    # part expects CLIP: it refuses files with T5 layers).
    assert "transformer" in reference._lora_loadable_modules
    for name, seed in (("A", 1), ("B", 2)):
        path = write_lora(model, tmp_path / name, rank=4, seed=seed)
        store.add(name, path)
        reference.load_lora_weights(path, adapter_name=name)
    req = lambda rid, **kw: make_request(request_id=rid, model=model, steps=4, **kw)  # noqa: E731
    plan = {0: [(req("base", seed=1), []), (req("a", seed=2, loras=(("A", 1.0),)), [])],
            1: [(req("a+b", seed=3, guidance=3.0, negative_prompt="dull",
                     loras=(("A", 0.5), ("B", 0.8))), [])]}
    done, _ = run(StepEngine(family, adapters=store), plan)
    for group in plan.values():
        for r, _ in group:
            pipe = with_adapters(reference, list(r.loras))
            expected = solo(SimpleNamespace(pipe=pipe, call_kwargs=loaded.call_kwargs), {}, r)
            assert max_diff(done[r.request_id].images, expected) <= 2, (model, r.request_id)
    unadapted = solo(loaded, pipelines, dataclasses.replace(plan[0][1][0], loras=()))
    assert max_diff(done["a"].images, unadapted) > 8  # the adapter changes the image visibly


@pytest.mark.parametrize("model", sorted(NO_CFG))
def test_the_embedded_build_reloads_offline_and_generates(model, tmp_path):
    EMBEDDED[model][1](tmp_path)
    defaults = serving_defaults(str(tmp_path))
    assert (defaults["width"], defaults["height"], defaults["num_inference_steps"]) == (64, 64, 4)
    pipe = DiffusionPipeline.from_pretrained(tmp_path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe).__name__ == {"tiny-z-image": "ZImagePipeline",
                                   "tiny-chroma": "ChromaPipeline"}[model]
    with torch.inference_mode():
        images = pipe(prompt=["a red circle"] * 2, num_inference_steps=2, height=64, width=64,
                      generator=[torch.Generator("cpu").manual_seed(s) for s in (0, 1)],
                      output_type="np").images
    assert images.shape == (2, 64, 64, 3) and not np.array_equal(images[0], images[1])
