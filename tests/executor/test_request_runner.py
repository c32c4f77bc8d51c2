"""Request mode in process: one batched call gives each request what it would get alone, edits
included; a pipeline that answers with the wrong size is an error, never wrong pixels."""

from __future__ import annotations

import pytest

from diffserve.config.flags import ServerConfig
from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.info import model_info
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.request.runner import RequestRunner
from diffserve.wire.protocol import REQUEST_MODE
from diffserve.wire.request import Work, WorkItem
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, sample_image, solo


def runner_for(model: str, **callbacks):
    loaded = load_model(model, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe)
    family_cls = family_for(loaded.pipeline_class)
    family = family_cls(loaded.pipe, pipelines, loaded.call_kwargs) if family_cls else None
    return loaded, pipelines, RequestRunner(loaded, pipelines, family, **callbacks)


@pytest.fixture(scope="module", params=["tiny-sd", "tiny-flux"])
def loaded_runner(request):
    return request.param, *runner_for(request.param)


def work(*requests, frames=None):
    items = [WorkItem(r, 0, r.n) for r in requests]
    return Work(1, items), frames or [[] for _ in items]


def test_model_info(loaded_runner):
    model, loaded, edits, _ = loaded_runner
    info = model_info(loaded, ServerConfig(model=model), REQUEST_MODE, None, list(edits))
    assert (info.width, info.height) == (64, 64)
    assert info.spatial_stride == (16 if model == "tiny-flux" else 8) and info.default_steps == 4
    assert info.device == "cpu" and info.dtype == "float32"
    assert info.tasks == ["generate", "image-to-image", "inpaint"]


def test_batched_requests_equal_their_solo_runs(loaded_runner):
    model, loaded, edits, runner = loaded_runner
    requests = [make_request(request_id="a", model=model, prompt="a red circle", seed=11),
                make_request(request_id="b", model=model, prompt="a blue square", seed=22, n=2),
                make_request(request_id="c", model=model, prompt="noise", seed=11)]
    outcomes = runner.execute(*work(*requests))
    assert [o.error for o in outcomes] == [None] * 3
    for r, o in zip(requests, outcomes):
        assert o.images.shape == (r.n, 64, 64, 3)
        assert max_diff(o.images, solo(loaded, edits, r)) <= 2, r.request_id
    assert max_diff(outcomes[0].images, outcomes[2].images) > 0  # same seed, other prompt


def test_batched_edits_equal_their_solo_edits(loaded_runner):
    model, loaded, edits, runner = loaded_runner
    image, mask = sample_image(64)
    other, _ = sample_image(64, seed=1)
    for task, frames in (("image-to-image", [[image], [other]]),
                         ("inpaint", [[image, mask], [other, mask]])):
        requests = [make_request(request_id=f"{task}-{i}", model=model, task=task, strength=0.7,
                                 steps=6, seed=5 + i, prompt=f"edit number {i}") for i in range(2)]
        outcomes = runner.execute(*work(*requests, frames=frames))
        for r, f, o in zip(requests, frames, outcomes):
            assert o.error is None, o.error
            assert max_diff(o.images, solo(loaded, edits, r, *f)) <= 2, r.request_id


def test_a_failing_batch_is_retried_per_request_so_only_the_culprit_fails(loaded_runner):
    model, loaded, edits, runner = loaded_runner
    image, _ = sample_image(64)
    good = make_request(request_id="good", model=model, task="image-to-image", strength=0.5, seed=1)
    broken = make_request(request_id="broken", model=model, task="image-to-image", strength=0.5)
    outcomes = runner.execute(*work(good, broken, frames=[[image], [b"\x00" * 10]]))
    assert [o.item.request.request_id for o in outcomes if o.error] == ["broken"]
    (ok,) = [o for o in outcomes if not o.error]
    assert max_diff(ok.images, solo(loaded, edits, good, image)) <= 2


def test_previews_in_request_mode():
    seen = []
    _, _, runner = runner_for("tiny-sd", emit_partial=seen.append)
    r = make_request(request_id="p", steps=6, partial_images=2, n=2)
    quiet = make_request(request_id="q", steps=6)
    (out, _) = runner.execute(*work(r, quiet))
    assert [(p.request_id, p.index, p.partial_index) for p in seen] == [
        ("p", 0, 0), ("p", 1, 0), ("p", 0, 1), ("p", 1, 1)]


def test_a_request_retried_alone_streams_each_preview_once():
    """The batched call fails after its previews were sent (here: its final decode of both
    images at once fails, as running out of memory would); each request then runs alone, and
    the previews it already streamed are not sent again."""
    seen = []
    loaded, pipelines, runner = runner_for("tiny-sd", emit_partial=seen.append)
    vae, decode = loaded.pipe.vae, loaded.pipe.vae.decode
    calls = []

    def decode_one_at_a_time(latents, *args, **kwargs):
        calls.append(latents.shape[0])
        if len(calls) == 3:  # the two batched previews went through; the final decode fails
            raise RuntimeError("out of memory")
        return decode(latents, *args, **kwargs)

    vae.decode = decode_one_at_a_time
    try:
        requests = [make_request(request_id=rid, steps=6, partial_images=2, seed=i)
                    for i, rid in enumerate(("x", "y"))]
        outcomes = runner.execute(*work(*requests))
    finally:
        vae.decode = decode
    assert [o.error for o in outcomes] == [None, None]
    assert calls[:3] == [2, 2, 2]  # the batched call's previews, then its failed final decode
    sent = [(p.request_id, p.index, p.partial_index) for p in seen]
    assert sorted(sent) == [("x", 0, 0), ("x", 0, 1), ("y", 0, 0), ("y", 0, 1)]
    for r, o in zip(requests, outcomes):
        assert max_diff(o.images, solo(loaded, pipelines, r)) <= 2


def test_mixed_negative_prompts_on_sdxl_equal_their_solo_runs():
    # SDXL encodes a missing negative prompt as zeros, not as "": a call never mixes them.
    loaded, edits, runner = runner_for("tiny-sdxl")
    requests = [make_request(request_id="with", model="tiny-sdxl", negative_prompt="blurry", seed=1),
                make_request(request_id="without", model="tiny-sdxl", seed=2)]
    for r, o in zip(requests, runner.execute(*work(*requests))):
        assert max_diff(o.images, solo(loaded, edits, r)) <= 2, r.request_id


def test_resolution_binning_is_off_and_a_wrong_output_size_is_an_error():
    # HunyuanDiT's resolution binning makes 1024x1024 images for a 64x64 request by default.
    loaded, edits, runner = runner_for("tiny-hunyuandit")
    r = make_request(request_id="h", model="tiny-hunyuandit", steps=1)
    (ok,) = runner.execute(*work(r))
    assert ok.error is None and ok.images.shape == (1, 64, 64, 3)
    loaded.call_kwargs["use_resolution_binning"] = True  # what the pipeline does left alone
    (wrong,) = runner.execute(*work(r))
    assert wrong.images is None
    assert "HunyuanDiTPipeline returned 1024x1024 images for a 64x64 request" in wrong.error


def test_an_out_of_memory_call_is_retried_in_halves_holding_nothing_of_the_failed_one():
    """Request mode as step mode: a batched call that runs out of memory is run again in halves
    once the failed call's tensors are gone and the memory released."""
    import weakref

    import torch

    from diffserve.executor.memory import oom as memory

    loaded, pipelines, runner = runner_for("tiny-sd")
    pipe, held, gone_at_retry, released = loaded.pipe, [], [], []
    call = type(pipe).__call__

    def fails_once(self, **kwargs):
        if held:
            gone_at_retry.append(held[-1]() is None)
        if len(held) < 1 and len(kwargs["prompt"]) > 1:
            activations = torch.empty(len(kwargs["prompt"]), 1 << 16)
            held.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return call(self, **kwargs)

    release = memory.release
    memory.release = lambda error: released.append(memory.is_out_of_memory(error)) or release(error)
    type(pipe).__call__ = fails_once
    try:
        requests = [make_request(request_id=f"r{i}", seed=i, steps=2) for i in range(2)]
        outcomes = runner.execute(*work(*requests))
    finally:
        type(pipe).__call__ = call
        memory.release = release
    assert [o.status for o in outcomes] == ["finished", "finished"]
    assert gone_at_retry == [True, True] and released == [True]
    for r, o in zip(requests, outcomes):
        assert max_diff(o.images, solo(loaded, pipelines, r)) <= 2
