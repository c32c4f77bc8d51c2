"""The device layer (``diffserve.device``): the CPU's answers, the fake GPU's, which kind answers
for a device and which is the process's own, the choice of an executor's device, and the
executor's CUDA-only decisions taken through the layer (run here on the fake GPU)."""

from __future__ import annotations

import threading
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from diffserve import device as layer
from diffserve.config.flags import ConfigError
from diffserve.device import current, installed, of
from diffserve.device.choice import pick_device, use_device, visible_gpus
from diffserve.device.cpu import CpuDevice
from diffserve.device.cuda import NCCL_ERROR_HANDLING, CudaDevice
from diffserve.device.fake import GiB, FakeCuda
from diffserve.device.stats import DeviceStats, synced_clock


def test_the_cpus_answers():
    cpu = of("cpu")
    assert isinstance(cpu, CpuDevice) and of(torch.device("cpu")) is cpu
    assert (cpu.kind, cpu.queued, cpu.pinned, cpu.count()) == ("cpu", False, False, 0)
    assert cpu.free_total("cpu") is None and cpu.allocated("cpu") is None
    assert cpu.total("cpu") is None and cpu.memory_fraction("cpu") == 1.0
    assert cpu.stream("cpu") is None and isinstance(cpu.on_stream(None), nullcontext)
    with pytest.raises(RuntimeError, match="no events"):
        cpu.event()
    assert (cpu.dist_backend, cpu.dist_env, cpu.describe("cpu")) == ("gloo", {}, {})
    assert not cpu.host_buffer(4, torch.float32).is_pinned()
    cpu.synchronize("cpu"), cpu.empty_cache(), cpu.empty_host_cache()  # nothing to do
    assert isinstance(of("meta"), CpuDevice)  # any kind without queued work answers the same


def test_the_process_device_is_chosen_once_and_is_the_cpu_without_a_gpu():
    assert current() is current()
    if not torch.cuda.is_available():
        assert current() is of("cpu") and of("cuda").count() == 0
    assert isinstance(of("cuda:3"), CudaDevice) and of("cuda:3") is of("cuda")


def test_a_fake_gpu_answers_for_cuda_inside_the_block_only():
    before_cuda, before_current = of("cuda"), current()
    with installed(FakeCuda(count=4, name="NVIDIA H200", capability=(9, 0), total=141 * GiB,
                            free=100 * GiB, bf16_native=False)) as fake:
        assert of("cuda:2") is fake and current() is fake and of("cpu") is not fake
        assert (fake.count(), fake.name("cuda:2"), fake.capability("cuda:2")) == (4, "NVIDIA H200", (9, 0))
        assert fake.free_total("cuda:2") == (100 * GiB, 141 * GiB) and fake.total("cuda:2") == 141 * GiB
        assert fake.describe("cuda:2") == {"name": "NVIDIA H200", "capability": [9, 0]}
        assert not fake.bf16_native("cuda:2")
        assert fake.dist_backend == "cpu:gloo,cuda:nccl"
        start, end = fake.event(timing=True), fake.event(timing=True)
        start.record(), end.record()
        assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
    assert of("cuda") is before_cuda and current() is before_current


def test_nccl_errors_raise_in_the_rank_instead_of_ending_the_process():
    """Mode 2 is torch's CleanUpOnly: the watchdog aborts the communicators (the waiting
    collective raises, and the group's failure check matches it); 1 and 3 tear the process down."""
    assert NCCL_ERROR_HANDLING == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert of("cuda").dist_env == NCCL_ERROR_HANDLING and of("cpu").dist_env == {}
    header = (Path(torch.__file__).parent /
              "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
    if header.exists():  # the meaning of the value, as this torch defines it
        text = header.read_text()
        assert "CleanUpOnly = 2" in text
        assert "#define SHOULD_TEAR_DOWN(a) (a != NoHandling && a != CleanUpOnly)" in text


def test_an_executors_device_is_chosen_from_the_visible_gpus_and_made_current():
    with installed(FakeCuda(count=2)) as fake:
        assert [pick_device("auto", i) for i in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
        use_device("cuda:1")
        assert fake.current == "cuda:1"
        use_device("cpu")  # nothing to make current
        assert fake.current == "cuda:1"
    with installed(FakeCuda(count=0)):
        assert pick_device("auto", 1) == "cpu"


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    for listed, count in [("0,1", 2), ("4, 5,6", 3), ("", 0), ("-1", 0)]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
        assert visible_gpus() == count


def test_the_memory_budget_is_a_share_of_the_cards_total():
    from diffserve.executor.memory.budget import budget_of

    config = SimpleNamespace(device_memory_bytes=0, gpu_memory_utilization=0.5)
    with installed(FakeCuda(total=80 * GiB)):
        assert budget_of(config, "cuda:0") == 40 * GiB
        config.device_memory_bytes = 10 * GiB
        assert budget_of(config, "cuda:0") == 10 * GiB
    with pytest.raises(ConfigError, match="share of a GPU"):
        budget_of(config, "cpu")


def test_out_of_memory_and_the_float32_reference_empty_the_cache():
    from diffserve.executor.checks.float32 import in_float32
    from diffserve.executor.memory.oom import release

    with installed(FakeCuda()) as fake:
        release(ValueError("not memory"))
        assert fake.emptied == 0
        release(torch.OutOfMemoryError("CUDA out of memory"))
        assert fake.emptied == 1
        pipe = SimpleNamespace(components={"transformer": torch.nn.Linear(2, 2).to(torch.bfloat16)})
        with in_float32(pipe):
            assert pipe.components["transformer"].weight.dtype == torch.float32
        assert pipe.components["transformer"].weight.dtype == torch.bfloat16
        assert fake.emptied == 2


def test_statistics_and_the_clock_ask_the_named_device():
    with installed(FakeCuda(count=2, allocated=5)) as fake:
        stats = DeviceStats("cuda:1")
        assert stats.counted and stats.allocated() == 5
        synced_clock("cuda:1", lambda: 7.0)
    assert fake.asked == [("allocated", torch.device("cuda:1")),
                          ("synchronize", torch.device("cuda:1"))]
    assert not DeviceStats("cpu").counted and DeviceStats("cpu").allocated() is None


def test_a_stage_on_a_gpu_hands_its_results_over_by_events():
    """The encode/decode stage's CUDA path (its own stream, events each way) runs on the fake."""
    from diffserve.executor.step.stages import StageJob, Stage

    done = threading.Event()
    with installed(FakeCuda()):
        stage = Stage("test", torch, "cuda:0", True, done.set)
    assert stage.queued and stage.stream is not None
    try:
        stage.submit(StageJob({"r"}, lambda: torch.ones(2)))
        assert done.wait(10)
        (job,) = stage.take()
        assert job.error is None and torch.equal(job.result, torch.ones(2))
        assert job.done is not None  # recorded on the stage's stream
    finally:
        stage.close()


def test_layer_state_is_left_as_found():
    assert not isinstance(of("cuda"), FakeCuda) and not isinstance(current(), FakeCuda)
    assert not any(isinstance(kind, FakeCuda) for kind in layer._kinds.values())
