"""Rows of different sizes in one transformer forward (diffserve.executor.families.row_sizes),
in process: requests of five sizes and aspect ratios share forwards in one running set, and each
image equals its family's plain diffusers pipeline called alone (within 2/255)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from diffserve.executor.checks.reference import max_diff, sample_image, solo
from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.step.engine import StepEngine
from diffserve.wire.request import WorkItem
from helpers import make_request

# Five sizes and aspect ratios (square, wide, tall, small, large), six requests.
SIZES = [(64, 64), (96, 64), (64, 96), (48, 48), (80, 80), (64, 64)]
MIXED = frozenset({"generate", "image-to-image", "inpaint", "rollout"})


def engine_for(model: str, mixed=MIXED):
    torch.manual_seed(0)
    loaded = load_model(model, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe)
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    return loaded, pipelines, StepEngine(family, mixed_sizes=mixed)


@pytest.fixture(scope="module", params=["tiny-flux", "tiny-qwen-image", "tiny-z-image",
                                                "tiny-chroma", "tiny-flux2", "tiny-flux2-klein",
                                                "tiny-sd3", "tiny-pixart-sigma"])
def mixed(request):
    return request.param, *engine_for(request.param)


def burst(model: str, **kw):
    # Guidance where the model runs it (Qwen-Image: true CFG, with a negative prompt).
    negative = {"negative_prompt": "blurry", "guidance": 4.0} if "flux" not in model else {}
    return [make_request(request_id=f"r{i}", model=model, width=w, height=h, seed=10 + i,
                         steps=4 + i % 3, prompt=f"a picture {i}", **(negative if i % 2 else {}),
                         **kw)
            for i, (w, h) in enumerate(SIZES)]


def drain(engine, requests, frames=None):
    failed = engine.admit([WorkItem(r, 0, r.n) for r, in zip(requests)],
                          frames or [[] for _ in requests])
    assert not failed, [f.error for f in failed]
    images, per_forward = {}, []
    while engine:
        out = engine.step()
        per_forward.append(out.samples)
        for o in out.finished:
            assert o.error is None, o.error
            images[o.item.request.request_id] = o.images
    return images, per_forward


def test_six_requests_of_five_sizes_share_forwards_and_equal_their_solo_runs(mixed):
    model, loaded, pipelines, engine = mixed
    requests = burst(model)
    images, per_forward = drain(engine, requests)
    assert len(engine.running_sets()) == 0
    # One running set: every forward carries every request still running.
    assert per_forward[0] == len(requests)
    assert sum(per_forward) / len(per_forward) >= 3
    for r in requests:
        image = images[r.request_id]
        assert image.shape[1:3] == (r.height, r.width)
        assert max_diff(image, solo(loaded, pipelines, r)) <= 2, (model, r.request_id)


def test_edits_of_different_sizes_share_forwards(mixed):
    model, loaded, pipelines, engine = mixed
    if not engine.family.strength_pipelines:
        pytest.skip(f"{model} has no image-to-image or inpainting pipeline")
    requests, frames = [], []
    for i, (w, h) in enumerate([(64, 64), (96, 64), (48, 48)]):
        image, mask = sample_image(max(w, h))
        image, mask = image[:h, :w].copy(), mask[:h, :w].copy()
        task = "inpaint" if i % 2 else "image-to-image"
        requests.append(make_request(request_id=f"e{i}", model=model, width=w, height=h,
                                     task=task, strength=0.7, steps=5, seed=i, guidance=3.5))
        frames.append([image, mask] if task == "inpaint" else [image])
    images, per_forward = drain(engine, requests, frames)
    assert per_forward[0] == 3
    for r, f in zip(requests, frames):
        assert max_diff(images[r.request_id], solo(loaded, pipelines, r, *f)) <= 2, r.request_id


def test_a_wide_and_a_tall_image_of_equal_tokens_keep_their_own_positions(mixed):
    model, loaded, pipelines, engine = mixed
    requests = [make_request(request_id=f"{w}x{h}", model=model, width=w, height=h, seed=3,
                             steps=3) for w, h in ((96, 64), (64, 96))]
    images, per_forward = drain(engine, requests)
    assert per_forward == [2, 2, 2]
    for r in requests:
        assert max_diff(images[r.request_id], solo(loaded, pipelines, r)) <= 2, r.request_id


def test_rollouts_of_different_sizes_share_forwards(mixed):
    model, loaded, pipelines, engine = mixed
    if model == "tiny-qwen-image":
        pytest.skip("one flow-matching family's rollouts suffice here (tests/test_rollouts.py)")
    if "rollout" not in task_pipelines(loaded.pipe, type(engine.family)):
        pytest.skip(f"{model} has no rollouts (its sampler is not flow matching)")
    plain = [make_request(request_id=f"plain{w}", model=model, task="rollout", width=w,
                          height=h, seed=5, steps=4, guidance=2.0) for w, h in ((64, 64), (96, 48))]
    plain = [dataclasses.replace(r, returns=("images",)) for r in plain]
    sampled = dataclasses.replace(plain[1], request_id="sampled", noise_level=0.8,
                                  returns=("latents", "log_probs", "images"))
    done = {}
    engine.admit([WorkItem(r, 0, 1) for r in [*plain, sampled]], [[], [], []])
    carried = []
    while engine:
        out = engine.step()
        carried.append(out.samples)
        done.update({o.item.request.request_id: o for o in out.finished})
    assert carried[0] == 3
    for r in plain:  # without noise, the sampler is the pipeline's own step
        generation = dataclasses.replace(r, task="generate", returns=())
        assert max_diff(done[r.request_id].images, solo(loaded, pipelines, generation)) <= 2
    tensors = done["sampled"].tensors
    assert tensors["images"].shape == (1, 48, 96, 3)
    assert np.isfinite(tensors["log_probs"]).all() and tensors["latents"].shape[1] == 5


def test_without_mixing_each_size_keeps_its_own_set():
    _, _, engine = engine_for("tiny-flux", mixed=frozenset())
    requests = burst("tiny-flux")
    engine.admit([WorkItem(r, 0, r.n) for r in requests], [[] for _ in requests])
    assert len(engine.running_sets()) == 5


@pytest.mark.parametrize("model", [
    "tiny-flux-kontext",
    # Its references go through the VAE at about 1024x1024 (4,096 tokens each): a minute here.
    pytest.param("tiny-qwen-image-edit", marks=pytest.mark.slow)])
def test_instruction_edits_of_different_sizes_share_forwards(model):
    """Each row's reference tokens after its own image's, padded per row."""
    loaded, pipelines, engine = engine_for(model, frozenset({"edit"}))
    requests, frames = [], []
    for i, (w, h) in enumerate([(64, 64), (96, 64), (48, 48)]):
        image, _ = sample_image(max(w, h), seed=i)
        requests.append(make_request(request_id=f"e{i}", model=model, width=w, height=h,
                                     task="edit", references=1, steps=4, seed=i, guidance=3.5))
        frames.append([image[:h, :w].copy()])
    images, per_forward = drain(engine, requests, frames)
    assert per_forward[0] == 3
    for r, f in zip(requests, frames):
        expected = solo(loaded, pipelines, r, references=f)
        assert max_diff(images[r.request_id], expected) <= 2, r.request_id


def test_a_kernel_without_masks_gives_way_to_native_in_a_mixed_forward():
    """A backend chosen for forwards of one size (a flash kernel takes no mask) must not fail
    a forward of several: it runs on native there."""
    from diffserve.executor.families.row_sizes import masked_backend
    from diffusers.models.attention_dispatch import AttentionBackendName

    class Processor:
        _attention_backend = AttentionBackendName._NATIVE_FLASH

    assert masked_backend(Processor()) == AttentionBackendName.NATIVE
    Processor._attention_backend = AttentionBackendName._NATIVE_MATH
    assert masked_backend(Processor()) == AttentionBackendName._NATIVE_MATH


@pytest.mark.parametrize("model", ["tiny-wan", "tiny-wan22"])
def test_videos_of_different_sizes_and_frame_counts_share_forwards(model):
    """Wan (2.2: both experts): rows padded along frames, height and width, self-attention
    masked to each row's own cells; each video equals its pipeline alone."""
    loaded, pipelines, engine = engine_for(model)
    shapes = [(32, 32, 9), (48, 32, 5), (32, 48, 9), (32, 32, 13)]
    requests = [dataclasses.replace(
        make_request(request_id=f"v{i}", model=model, width=w, height=h, seed=i, steps=4,
                     guidance=4.0 if i % 2 else 1.0), num_frames=frames)
        for i, (w, h, frames) in enumerate(shapes)]
    videos, per_forward = drain(engine, requests)
    assert per_forward[0] == len(requests)
    for r in requests:
        assert videos[r.request_id].shape[1:4] == (r.num_frames, r.height, r.width)
        assert max_diff(videos[r.request_id], solo(loaded, pipelines, r)) <= 2, r.request_id


def test_the_padding_is_counted_as_each_family_pads():
    """Tokens padded to the longest row's (Flux), or to the union grid (SD3): what the
    forward's padding metric reads."""
    flux, sd3 = (engine_for(model)[2] for model in ("tiny-flux", "tiny-sd3"))
    for engine, wide_tall in ((flux, 0), (sd3, 1)):
        requests = [make_request(request_id=f"{w}x{h}", model="tiny-flux" if engine is flux
                                 else "tiny-sd3", width=w, height=h, steps=2, guidance=1.0)
                    for w, h in ((96, 64), (64, 96))]
        engine.admit([WorkItem(r, 0, 1) for r in requests], [[], []])
        out = engine.step()
        # 96x64: 24 tokens of 2x2 latent cells either way; one grid of 96x96 holds 36 each.
        assert (out.size, out.tokens, out.padding) == ("mixed", 48, 24 * wide_tall), engine.family
        drain(engine, [])
