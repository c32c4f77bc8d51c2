"""A parallel group as its ranks see it: what each rank needs to join (:class:`RankSpec`), and the
group once joined (:class:`Group`): its torch.distributed world, its meshes, and the few
collectives the step engine itself calls (a broadcast of the leader's decisions, the sums of a
step-cache signal, the rows of CFG parallelism's branches).

The ranks of a group form their own torch.distributed world (NCCL on CUDA, with gloo beside it
for host tensors; gloo on the CPU) on a loopback port of their own; every collective is bounded by
``--collective-timeout-s``. How the model is spread over the ranks is
:mod:`~diffserve.executor.parallel.model`; how the ranks stay in step,
:mod:`~diffserve.executor.parallel.ranks`.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

from diffserve.device import of
from diffserve.config.executors import Degrees

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to join its group."""

    group: int  # the executor index the group serves as
    rank: int
    degrees: Degrees
    devices: tuple[str, ...]  # one per rank
    port: int  # torch.distributed's rendezvous, on loopback
    timeout_s: float

    @property
    def device(self) -> str:
        return self.devices[self.rank]

    @property
    def cfg_rank(self) -> int:
        return self.rank // self.degrees.model_ranks


def rank_title(group: int, rank: int) -> str:
    return f"diffserve::executor-{group}.r{rank}"





class Group:
    """A rank's view of its group, once joined."""

    def __init__(self, spec: RankSpec) -> None:
        import torch
        import torch.distributed as dist

        self.spec = spec
        self.degrees = spec.degrees
        self.rank = spec.rank
        self.torch, self.dist = torch, dist
        kind = of(spec.device)
        for name, value in kind.dist_env.items():  # unless the operator chose otherwise
            os.environ.setdefault(name, value)
        # Its own GPU, inside the operator's visible set, current before NCCL starts on it.
        kind.set_current(spec.device)
        dist.init_process_group(kind.dist_backend,
                                init_method=f"tcp://127.0.0.1:{spec.port}", rank=spec.rank,
                                world_size=spec.degrees.size,
                                timeout=datetime.timedelta(seconds=spec.timeout_s))
        d = spec.degrees
        shape, names = ((d.cfg, d.tp), ("cfg", "tp")) if d.tp > 1 else (
            (d.cfg, d.ring, d.ulysses), ("cfg", "ring", "ulysses"))
        self.mesh = torch.distributed.device_mesh.init_device_mesh(
            kind.kind, shape, mesh_dim_names=names)
        self.cfg_group = self.mesh["cfg"].get_group() if d.cfg > 1 else None
        # The ranks one forward's sequence is split over (context parallelism).
        self.context_group = (self.mesh["ring", "ulysses"]._flatten().get_group()
                              if d.context else None)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def model_mesh(self):
        """This rank's CFG branch's mesh: ("ring", "ulysses"), or ("tp",)."""
        return self.mesh["tp"] if self.degrees.tp > 1 else self.mesh["ring", "ulysses"]

    def broadcast(self, value):
        """The leader's ``value`` on every rank (any picklable object)."""
        box = [value]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def reduce_sums(self, tensor):
        """``tensor`` summed over the ranks that split the sequence (a step-cache signal's sums
        are each rank's share of the tokens): every rank then decides alike."""
        if self.context_group is not None:
            self.dist.all_reduce(tensor, group=self.context_group)
        return tensor

    def gather_rows(self, mine, counts: list[int]):
        """CFG parallelism: every CFG branch's rows (``counts[b]`` rows of branch b; ``mine``
        this branch's), stacked branch after branch, on every rank. One all-gather, each part
        padded to the largest."""
        torch = self.torch
        most = max(counts)
        padded = mine if len(mine) == most else torch.cat(
            [mine, mine.new_zeros((most - len(mine), *mine.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in counts]
        self.dist.all_gather(parts, padded.contiguous(), group=self.cfg_group)
        return torch.cat([part[:n] for part, n in zip(parts, counts)])

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
