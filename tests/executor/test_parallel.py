"""diffserve/executor/parallel/topology.py's judgement of an error: the group's own (a peer gone, a
collective timed out: the group restarts and what it held runs again) or a request's."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from diffserve.executor.parallel.failures import is_group_failure

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

