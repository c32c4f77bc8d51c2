"""The model runner on both embedded families: one batched call gives each sample what it would
get alone."""

import numpy as np
import pytest

from diffserve.executor.runner import ModelRunner
from diffserve.protocol import Batch, Sample


@pytest.fixture(scope="module", params=["tiny-sd", "tiny-flux"])
def runner(request):
    return ModelRunner(request.param, request.param, torch_threads=2)


def params(runner, **overrides):
    info = runner.info
    p = {"model": info.name, "width": info.width, "height": info.height,
         "num_inference_steps": info.default_steps, "guidance_scale": info.default_guidance_scale}
    p.update(overrides)
    return p


SAMPLES = [Sample("a", 0, "a red circle", "", 11), Sample("b", 0, "a blue square", "", 22),
           Sample("b", 1, "a blue square", "", 23), Sample("c", 0, "noise", "", 11)]


def test_model_info(runner):
    info = runner.info
    assert (info.width, info.height) == (64, 64)
    assert info.spatial_stride in (8, 16) and info.default_steps == 4
    assert info.device == "cpu" and info.dtype == "float32"


def test_batched_samples_match_solo_runs(runner):
    batch = runner.generate(params(runner), SAMPLES)
    assert batch.shape == (4, 64, 64, 3) and batch.dtype == np.uint8
    for i, sample in enumerate(SAMPLES):
        alone = runner.generate(params(runner), [sample])[0]
        diff = np.abs(batch[i].astype(int) - alone.astype(int)).max()
        assert diff <= 2, f"sample {i} differs from its solo run by {diff}/255"
    # Every sample is its own image: different seeds or prompts give different pixels.
    for i in range(4):
        for j in range(i + 1, 4):
            assert np.abs(batch[i].astype(int) - batch[j].astype(int)).mean() > 1


def test_same_seed_and_prompt_reproduce(runner):
    a = runner.generate(params(runner), [SAMPLES[0]])
    b = runner.generate(params(runner), [SAMPLES[0]])
    assert np.array_equal(a, b)


def test_other_sizes_within_the_stride(runner):
    stride = runner.info.spatial_stride
    out = runner.generate(params(runner, width=64 + stride * 2, height=64), SAMPLES[:2])
    assert out.shape == (2, 64, 64 + stride * 2, 3)


def test_execute_returns_one_image_per_sample_with_metadata(runner):
    batch = Batch(7, params(runner), SAMPLES)
    result, images = runner.execute(batch)
    assert result.batch_id == 7 and not result.errors
    assert [(m.request_id, m.index, m.seed) for m in result.images] == [
        (s.request_id, s.index, s.seed) for s in SAMPLES]
    assert len(images) == 4 and all(img.flags["C_CONTIGUOUS"] for img in images)


def test_a_failing_batch_is_retried_per_request_so_only_the_culprit_fails(runner):
    real_generate = runner.generate

    def generate(p, samples):
        if any(s.prompt == "noise" for s in samples):
            raise RuntimeError("this prompt breaks the pipeline")
        return real_generate(p, samples)

    runner.generate = generate
    try:
        result, images = runner.execute(Batch(8, params(runner), SAMPLES))
    finally:
        del runner.generate
    assert list(result.errors) == ["c"] and "breaks the pipeline" in result.errors["c"]
    assert [m.request_id for m in result.images] == ["a", "b", "b"] and len(images) == 3
