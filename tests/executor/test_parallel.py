"""diffserve/executor/parallel/topology.py's judgement of an error: the group's own (a peer gone, a
collective timed out: the group restarts and what it held runs again) or a request's; and what a
model or machine cannot do in a group, refused before anything loads."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from diffserve.config.flags import ConfigError, ServerConfig
from diffserve.executor.parallel.failures import is_group_failure
from diffserve.executor.parallel.model import check_model
from diffserve.builders.registry import resolve_model

GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:{line}] {what}"


@pytest.mark.parametrize("what", [
    # Seen when a follower rank was killed mid-forward: once "reset", once "closed".
    "Read error [127.0.0.1]:64721: Connection reset by peer. This is typically caused by a remote "
    "worker hanging or bugs in the application. Check the logs of the remote worker before "
    "reporting an error. GLHF!",
    "Connection closed by peer [127.0.0.1]:41234",
    "Timed out waiting 60000ms for recv operation to complete",
])
def test_gloo_transport_errors_are_the_groups(what):
    assert is_group_failure(RuntimeError(GLOO.format(line=537, what=what)))


def test_a_dist_error_is_the_groups():
    assert is_group_failure(dist.DistBackendError("NCCL communicator was aborted"))


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ValueError("the scheduler step failed: index 11 is out of bounds for dimension 0 with size 10"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x64 and 32x64)"),
])
def test_a_requests_own_error_is_not(error):
    assert not is_group_failure(error)


@pytest.mark.parametrize("what", [
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLGATHER, "
    "NumelIn=4096, NumelOut=8192, Timeout(ms)=300000) ran for 300021 milliseconds before timing out.",
    "NCCL communicator was aborted on rank 0.",
    "NCCL error in: ProcessGroupNCCL.cpp:1935, remote process exited or there was a network error, "
    "NCCL version 2.26.2 ncclRemoteError: A call failed possibly due to a network error",
])
def test_nccl_timeouts_and_aborts_are_the_groups(what):
    """With asynchronous error handling on (set for a group's ranks), a timed-out NCCL collective
    raises in the waiting rank; whatever type it comes as, the group restarts."""
    assert is_group_failure(RuntimeError(what))



class Recorder:
    """A step engine's calls, recorded; its clock and its plan are its own (each rank's would
    differ: the leader's must be what every rank uses)."""

    def __init__(self, now: float, plan) -> None:
        self.now, self.next_plan, self.calls = now, plan, []

    def __bool__(self) -> bool:
        return True

    def clock(self) -> float:
        return self.now

    def plan(self):
        return self.next_plan

    def admit(self, items, inputs, arrived=None):
        self.calls.append(("admit", [i.request.request_id for i in items], arrived))

    def step(self, plan=None):
        self.calls.append(("step", plan if plan is not None else self.plan()))


def test_followers_use_the_leaders_arrival_times_and_plan():
    """Over the group's real control sockets: a follower whose clock and planner would answer
    differently admits with the leader's arrival times and runs the leader's plan."""
    import threading
    from types import SimpleNamespace

    import zmq

    from diffserve.executor.parallel.ranks import LeaderEngine, Link, follow

    ctx = zmq.Context()
    link = Link(ctx, 1)
    pull = ctx.socket(zmq.PULL)
    pull.connect(link.addresses[0])
    leader = Recorder(now=100.0, plan=("rows", [0, 1]))
    follower = Recorder(now=7.5, plan=("rows", [1]))
    thread = threading.Thread(target=follow, args=(pull, follower, None, None), daemon=True)
    thread.start()
    try:
        engine = LeaderEngine(leader, link)
        items = [SimpleNamespace(request=SimpleNamespace(request_id=f"r{i}"), queued_s=i * 0.5)
                 for i in range(2)]
        engine.admit(items, [[], []])
        engine.step()
        link.close()
        thread.join(timeout=30)
        assert not thread.is_alive()
        arrived = {"r0": 100.0, "r1": 99.5}
        assert leader.calls == follower.calls == [("admit", ["r0", "r1"], arrived),
                                                  ("step", ("rows", [0, 1]))]
    finally:
        pull.close()
        for sock in link.sockets:
            sock.close()
        ctx.term()


@pytest.mark.parametrize("model, flags, message", [
    ("tiny-sd", {"ulysses_degree": 2}, "--ulysses-degree: UNet2DConditionModel has no context-parallel plan"),
    ("tiny-flux", {"cfg_parallel_size": 2}, "--cfg-parallel-size 2: flux makes no classifier-free guidance rows"),
    ("tiny-flux", {"ring_degree": 2}, "--ring-degree: ring attention needs an attention backend"),
    ("tiny-flux", {"tensor_parallel_size": 2},
     "--tensor-parallel-size: diffusers' tensor parallelism refuses device type cpu"),
])
def test_what_a_model_cannot_do_in_a_group_is_refused_naming_the_flag(model, flags, message):
    """The leader's check, read off the model directory (the server's start runs it before the
    group's other ranks start: tests/test_parallel_groups.py)."""
    config = ServerConfig(model=model, **flags)
    with pytest.raises(ConfigError) as refused:
        check_model(config, resolve_model(model), "cpu")
    assert message in str(refused.value)


def test_what_a_model_can_do_in_a_group_passes_the_check():
    check_model(ServerConfig(model="tiny-flux", ulysses_degree=2), resolve_model("tiny-flux"), "cpu")
