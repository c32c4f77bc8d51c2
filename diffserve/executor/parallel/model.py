"""One model across the ranks of a group, parallelised with diffusers' own parallelism, and what a
model or machine cannot do in a group (refused before anything loads).

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

The text encoders and the VAE sit on every rank (context parallelism replicates the model anyway,
and each rank's step engine encodes and decodes what it runs); only the group's leader answers.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffserve.config.flags import ConfigError
from diffserve.wire.costs import NEVER
from diffserve.executor.families.known import family_for
from diffserve.executor.model.compat import on_rank_device, one_device_per_cpu_rank
from diffserve.executor.parallel.topology import Group
from diffserve.executor.pipeline import DENOISERS, declared_components, pipeline_class_of


def check_model(config, path: str, device: str) -> None:
    """Refuse, naming the flag and the reason, what this model or machine cannot do in a group:
    read off the model directory before anything loads (a group's other ranks start only once
    this passes)."""
    import diffusers

    d = config.degrees
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
    declared = declared_components(path) or {}
    for component, name in ((c, declared[c]) for c in DENOISERS if c in declared):
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

    for denoiser in family.denoisers:
        config = ContextParallelConfig(ring_degree=d.ring, ulysses_degree=d.ulysses,
                                       ulysses_anything=d.ring == 1, mesh=group.model_mesh())
        with one_device_per_cpu_rank(), on_rank_device(group.spec.device):
            denoiser.enable_parallelism(config=config)


def tensor_parallel_denoisers(path: str, group: Group, dtype) -> dict:
    """The denoiser(s) of the model at ``path``, loaded with their weights sharded over the TP
    ranks: pipeline components to load the rest of the pipeline around."""
    import diffusers
    from diffusers import TensorParallelConfig

    declared = declared_components(path) or {}
    found = {}
    for name in (n for n in DENOISERS if n in declared):  # check_model refused the others
        cls = getattr(diffusers, declared[name])
        with on_rank_device(group.spec.device):
            found[name] = cls.from_pretrained(path, subfolder=name, torch_dtype=dtype,
                                              parallel_config=TensorParallelConfig(
                                                  mesh=group.model_mesh()))
    return found
