"""Weight updates and sleeping in one executor, in process (diffserve.executor.rl.weights): an update
from a directory in diffusers' layout and one from a trainer's tensors in shared memory each make
the images of diffusers run alone with those weights; an update that does not fit is refused,
naming the first offending key, and changes nothing; a sync goes back to the model's own weights;
sleeping at level 2 frees every weight and the wake brings back the current version."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from diffserve.wire import shared_tensors
from diffserve.config.flags import ServerConfig
from diffserve.wire.weight_commands import BASE_VERSION, COMMIT, PATH, PREPARE, SHARED, SLEEP, SYNC, WAKE, \
    WeightSource, WeightStep
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.runtime import build_runtime
from diffserve.executor.rl.weights import WeightError, run_step
from helpers import make_request, run_plan
from diffserve.executor.checks.reference import max_diff, solo

MODEL = "tiny-flux"
REQUESTS = [make_request(request_id=f"r{i}", model=MODEL, prompt=f"a red circle {i}", seed=i,
                         steps=3, guidance=3.5) for i in range(2)]


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    directory = tmp_path_factory.mktemp("weights")
    return build_runtime(ServerConfig(model=MODEL, skip_startup_check=True,
                                      enable_weight_updates=True, weights_dir=str(directory)),
                         torch_threads=1)


def images(rt) -> dict:
    return run_plan(rt.step_engine(), {0: [(r, []) for r in REQUESTS]})


def trained(rt, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """The denoiser's weights moved as a training step would move them."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype)
            for k, v in rt.loaded.pipe.transformer.state_dict().items()}


def expected(state: dict[str, torch.Tensor]) -> dict:
    """diffusers alone, with ``state`` loaded into a fresh copy of the model."""
    loaded = load_model(MODEL, torch_threads=1)
    loaded.pipe.transformer.load_state_dict(state)
    pipelines = task_pipelines(loaded.pipe)
    return {r.request_id: solo(loaded, pipelines, r) for r in REQUESTS}


def step(rt, name: str, *sources, version: str = "", level: int = 1):
    result = run_step(rt.weights, WeightStep("c", name, list(sources), version, level))
    assert result.status == 200, result.error
    return result


def assert_close(got: dict, want: dict) -> None:
    for rid in want:
        assert max_diff(got[rid], want[rid]) <= 2, rid


def test_updates_from_disk_and_from_shared_memory_make_diffusers_images(rt, tmp_path):
    base = images(rt)
    first = trained(rt, 0.05, seed=1)
    layout = tmp_path / "step-1" / "transformer"
    layout.mkdir(parents=True)
    save_file(first, str(layout / "diffusion_pytorch_model.safetensors"))
    result = step(rt, PREPARE, WeightSource(PATH, str(layout.parent)))
    assert result.full and rt.weights.version == BASE_VERSION  # prepared, not applied
    step(rt, COMMIT, version="1")
    after_first = images(rt)
    assert_close(after_first, expected(first))
    assert any(max_diff(after_first[r], base[r]) > 2 for r in base), "the update changed nothing"

    second = trained(rt, 0.05, seed=2)
    name = shared_tensors.write(second, tmp_path)  # a trainer's tensors, a file in memory
    step(rt, PREPARE, WeightSource(SHARED, str(tmp_path / name)))
    step(rt, COMMIT, version="2")
    assert rt.weights.version == "2" and [s.kind for s in rt.weights.sources] == [SHARED]
    assert_close(images(rt), expected(second))

    step(rt, SYNC, version=BASE_VERSION)  # back to --model's own weights
    assert_close(images(rt), base)


def test_an_update_that_does_not_fit_is_refused_naming_the_key_and_changes_nothing(rt, tmp_path):
    before = {k: v.clone() for k, v in rt.loaded.pipe.transformer.state_dict().items()}
    state = trained(rt, 0.05, seed=3)
    key = next(iter(state))
    cases = {
        "unknown": ({**state, "not.a.weight": torch.zeros(2)}, "'not.a.weight' is not a weight"),
        "shape": ({**state, key: torch.zeros(3, 3)}, f"{key!r} has shape [3, 3]"),
        "dtype": ({**state, key: torch.zeros(state[key].shape, dtype=torch.int32)},
                  f"{key!r} is torch.int32"),
    }
    for case, (tensors, message) in cases.items():
        path = tmp_path / f"{case}.safetensors"
        save_file(tensors, str(path))
        result = run_step(rt.weights, WeightStep("c", PREPARE, [WeightSource(PATH, str(path))]))
        assert result.status == 400 and message in result.error, (case, result.error)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    result = run_step(rt.weights, WeightStep("c", PREPARE, [WeightSource(PATH, str(corrupt))]))
    assert result.status == 400 and "corrupt.safetensors could not be read" in result.error
    missing = run_step(rt.weights, WeightStep("c", PREPARE, [WeightSource(PATH, str(tmp_path / "no"))]))
    assert missing.status == 400 and "does not exist" in missing.error
    with pytest.raises(WeightError, match="nothing was prepared"):
        rt.weights.commit("9")
    after = rt.loaded.pipe.transformer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_level_2_frees_every_weight_and_the_wake_brings_back_the_current_version(rt, tmp_path):
    state = trained(rt, 0.05, seed=4)
    path = tmp_path / "update.safetensors"
    save_file(state, str(path))
    step(rt, PREPARE, WeightSource(PATH, str(path)))
    step(rt, COMMIT, version="7")
    made = images(rt)
    later = trained(rt, 0.02, seed=5)
    params = [p for m in rt.weights.modules().values() for p in m.parameters()]
    held = sum(p.numel() for p in params)
    step(rt, SLEEP, level=2)
    assert rt.weights.sleeping == 2 and sum(p.numel() for p in params) == 0
    # An update while asleep is checked against what the weights were, and applied at the wake.
    save_file(later, str(tmp_path / "later.safetensors"))
    step(rt, PREPARE, WeightSource(PATH, str(tmp_path / "later.safetensors")))
    step(rt, COMMIT, version="8")
    step(rt, WAKE)
    assert sum(p.numel() for p in params) == held and rt.weights.version == "8"
    assert_close(images(rt), expected(later))
    step(rt, SYNC, WeightSource(PATH, str(path)), version="7")  # back to version 7, exactly
    again = images(rt)
    assert all(np.array_equal(again[r], made[r]) for r in made)
    step(rt, SYNC, version=BASE_VERSION)


def test_a_prepared_update_holds_its_files_manifest_not_its_tensors(rt, tmp_path):
    """An update is streamed tensor by tensor at the commit: until then a rank holds what the
    files' headers say (shapes, dtypes), never the tensors themselves (8 ranks each holding a
    whole update would be 8 copies in host memory)."""
    from diffserve.executor.tensors import tensors_in

    state = trained(rt, 0.01, seed=6)
    save_file(state, str(tmp_path / "streamed.safetensors"))
    step(rt, PREPARE, WeightSource(PATH, str(tmp_path / "streamed.safetensors")))
    assert not list(tensors_in(rt.weights.staged, objects=True))
    step(rt, COMMIT, version="s")
    assert_close(images(rt), expected(state))
    step(rt, SYNC, version=BASE_VERSION)


def test_a_host_copy_holds_each_dtype_in_pinned_chunks_and_restores_the_same_parameters():
    from diffserve.executor.rl.sleep import HostCopy

    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    module[1].register_buffer("steps", torch.arange(3))
    before = {name: t.detach().clone() for name, t in module.state_dict().items()}
    params = list(module.parameters())
    copy = HostCopy(module)
    assert sorted(map(str, copy.buffers)) == ["torch.float32", "torch.int64"]
    (floats,) = copy.buffers[torch.float32]  # a small module: one chunk a dtype
    assert all(p.untyped_storage().data_ptr() == floats.untyped_storage().data_ptr() for p in params)
    copy.restore()
    assert list(module.parameters()) == params  # the same Parameter objects (PEFT, graphs)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("layout", [{"text_encoder_device": "cpu", "vae_device": "cpu"},
                                    {"offload": "model"}])
def test_level_1_with_placement_and_offload_serves_the_same_images_after_the_wake(layout, tmp_path):
    """Every component back where placement or offloading put it; the prompt cache's encodings
    are dropped while asleep. (On a CPU every place is the host: a GPU's check is gpu_check's
    ``rent`` section.)"""
    from diffserve.executor.rl.sleep import offloaded

    rt = build_runtime(ServerConfig(model=MODEL, skip_startup_check=True, enable_weight_updates=True,
                                    weights_dir=str(tmp_path), **layout), torch_threads=1)
    before = images(rt)
    assert len(rt.prompt_cache) > 0
    where = {n: str(next(m.parameters()).device) for n, m in rt.weights.modules().items()}
    step(rt, SLEEP, level=1)
    assert len(rt.prompt_cache) == 0
    if "offload" in layout:  # streamed by diffusers' hooks: left to them
        assert all(offloaded(m) for m in rt.weights.modules().values())
    step(rt, WAKE)
    assert {n: str(next(m.parameters()).device) for n, m in rt.weights.modules().items()} == where
    after = images(rt)
    assert all(np.array_equal(after[r], before[r]) for r in before)
