"""One model across the ranks of a group: the group's shape, each rank joining it, and the model
parallelised with diffusers' own parallelism.

- **Context parallelism** (``--ulysses-degree``, ``--ring-degree``): ``enable_parallelism`` with a
  ``ContextParallelConfig`` on each denoiser, driven by its ``_cp_plan``: every rank holds the
  whole model and the sequence of each forward is split between the ranks inside it (Ulysses:
  all-to-all of heads and tokens; ring: key/value chunks passed around). With Ulysses alone,
  ``ulysses_anything`` takes any sequence length, so running sets whose text lengths change as
  requests join and leave need no padding.
- **Tensor parallelism** (``--tensor-parallel-size``): the denoiser is loaded with a
  ``TensorParallelConfig``, which shards its weights while they are read (its ``_tp_plan``), so a
  denoiser larger than one device loads.
- **CFG parallelism** (``--cfg-parallel-size 2``), which diffusers does not have: the group's ranks
  split in two halves, the unconditional rows of every forward on one and the conditional rows on
  the other (:meth:`Group.gather_rows`).

The ranks of a group form their own torch.distributed world (NCCL on CUDA, gloo on the CPU) on a
loopback port of their own; every collective is bounded by ``--collective-timeout-s``. The text
encoders and the VAE sit on every rank (context parallelism replicates the model anyway, and each
rank's step engine encodes and decodes what it runs); only the group's leader answers.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

from diffserve.config import ConfigError
from diffserve.costs import NEVER

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Degrees:
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    tp: int = 1

    @classmethod
    def of(cls, config) -> "Degrees":
        return cls(config.ulysses_degree, config.ring_degree, config.cfg_parallel_size,
                   config.tensor_parallel_size)

    @property
    def model_ranks(self) -> int:
        """Ranks one copy of the model is spread over (one CFG branch)."""
        return self.tp if self.tp > 1 else self.ulysses * self.ring

    @property
    def size(self) -> int:
        return self.cfg * self.model_ranks

    @property
    def context(self) -> bool:
        return self.ulysses * self.ring > 1

    def describe(self, groups: int) -> dict[str, int]:
        return {"ulysses": self.ulysses, "ring": self.ring, "cfg": self.cfg, "tp": self.tp,
                "groups": groups}


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


class Group:
    """A rank's view of its group, once joined."""

    def __init__(self, spec: RankSpec) -> None:
        import torch
        import torch.distributed as dist

        self.spec = spec
        self.degrees = spec.degrees
        self.rank = spec.rank
        self.torch, self.dist = torch, dist
        cuda = spec.device.startswith("cuda")
        # On GPUs, gloo beside NCCL for host tensors: diffusers' Ulysses attention all-gathers each
        # rank's sequence length before its all-to-alls, on the host where the group has gloo
        # (no device round trip and synchronisation per attention).
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                                init_method=f"tcp://127.0.0.1:{spec.port}", rank=spec.rank,
                                world_size=spec.degrees.size,
                                timeout=datetime.timedelta(seconds=spec.timeout_s))
        d = spec.degrees
        shape, names = ((d.cfg, d.tp), ("cfg", "tp")) if d.tp > 1 else (
            (d.cfg, d.ring, d.ulysses), ("cfg", "ring", "ulysses"))
        self.mesh = torch.distributed.device_mesh.init_device_mesh(
            "cuda" if cuda else "cpu", shape, mesh_dim_names=names)
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


def check_model(config, path: str, device: str) -> None:
    """Refuse, naming the flag and the reason, what this model or machine cannot do in a group:
    read off the model directory before anything loads (a group's other ranks start only once
    this passes)."""
    import json
    from pathlib import Path

    import diffusers

    from diffserve.executor.devices import pipeline_class_of
    from diffserve.executor.families import family_for

    d = Degrees.of(config)
    pipeline = pipeline_class_of(path)
    if pipeline is None:  # a hub id: what diffusers refuses shows when the model loads
        return
    family = family_for(pipeline)
    if family is None:
        raise ConfigError(f"a parallel group ({d.size} ranks) runs the step engine, which does not "
                          f"know {pipeline}")
    on_cpu = not device.startswith("cuda")
    if d.ring > 1 and on_cpu:
        raise ConfigError("--ring-degree: ring attention needs an attention backend that returns "
                          "its log-sum-exp; the CPU's native one does not (GPUs only)")
    if d.tp > 1 and on_cpu:
        raise ConfigError("--tensor-parallel-size: diffusers' tensor parallelism refuses device "
                          "type cpu (GPUs only)")
    if d.cfg > 1 and family.guidance_rule == NEVER:
        raise ConfigError(f"--cfg-parallel-size 2: {family.name} makes no classifier-free "
                          "guidance rows (its guidance is distilled into the model)")
    index = json.loads((Path(path) / "model_index.json").read_text())
    for component in ("transformer", "transformer_2", "unet"):
        entry = index.get(component)
        if not isinstance(entry, list) or entry[1] is None:
            continue
        name = entry[1]
        cls = getattr(diffusers, name, None)
        config_file = Path(path) / component / "config.json"
        heads = (json.loads(config_file.read_text()).get("num_attention_heads")
                 if config_file.is_file() else None)
        if d.context and getattr(cls, "_cp_plan", None) is None:
            flag = "--ulysses-degree" if d.ulysses > 1 else "--ring-degree"
            raise ConfigError(f"{flag}: {name} has no context-parallel plan in diffusers (the "
                              "families with one: Flux, FLUX.2, Qwen-Image, Wan)")
        if d.tp > 1 and getattr(cls, "_tp_plan", None) is None:
            raise ConfigError(f"--tensor-parallel-size: {name} has no tensor-parallel plan in "
                              "diffusers (Flux, FLUX.2 and Qwen-Image have one)")
        split_heads = d.tp if d.tp > 1 else (d.ulysses if d.ring > 1 else 1)
        if isinstance(heads, int) and split_heads > 1 and heads % split_heads:
            flag = "--tensor-parallel-size" if d.tp > 1 else "--ulysses-degree"
            raise ConfigError(f"{flag}={split_heads}: {name} has {heads} attention heads, not a "
                              f"multiple of {split_heads}")


def parallelize(pipe, family, group: Group) -> None:
    """Context parallelism on every denoiser of ``family`` (tensor parallelism is applied as the
    weights load)."""
    d = group.degrees
    if not d.context:
        return
    from diffusers import ContextParallelConfig

    from diffserve.executor.compat import one_device_per_cpu_rank

    for denoiser in family.denoisers:
        config = ContextParallelConfig(ring_degree=d.ring, ulysses_degree=d.ulysses,
                                       ulysses_anything=d.ring == 1, mesh=group.model_mesh())
        with one_device_per_cpu_rank():
            denoiser.enable_parallelism(config=config)


def tensor_parallel_denoisers(path: str, group: Group, dtype) -> dict:
    """The denoiser(s) of the model at ``path``, loaded with their weights sharded over the TP
    ranks: pipeline components to load the rest of the pipeline around."""
    import json
    from pathlib import Path

    import diffusers
    from diffusers import TensorParallelConfig

    index = json.loads((Path(path) / "model_index.json").read_text())
    found = {}
    for name in ("transformer", "transformer_2"):
        entry = index.get(name)
        if not isinstance(entry, list) or entry[1] is None:
            continue
        cls = getattr(diffusers, entry[1])
        found[name] = cls.from_pretrained(path, subfolder=name, torch_dtype=dtype,
                                          parallel_config=TensorParallelConfig(
                                              mesh=group.model_mesh()))
    return found


# What gloo's transport says when a peer is gone or silent. It raises them as plain
# RuntimeErrors, not DistErrors, and which one comes depends on when the peer died: a rank killed
# mid-collective gives "Connection reset by peer" on one run and "closed" on the next.
TRANSPORT_FAILURES = ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                      "Socket closed", "Read error", "Read timeout", "Timed out waiting")


def is_group_failure(error: BaseException) -> bool:
    """An error of the group itself (a peer gone, a collective timed out), which no retry of a
    smaller batch can help: the group must go down and start again."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(marker in text for marker in TRANSPORT_FAILURES)
