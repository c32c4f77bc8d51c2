"""Several models in one server: ``--model`` given as NAME=PATH, once or more.

Each model runs in an engine of its own (a scheduler and its executors, as one model always
has), made from :func:`for_model`'s configuration. What ties to which model:

- a model's own ``diffserve.json`` (size, steps, guidance, control models) applies to it alone,
  as it is read where that model loads;
- ``--lora-modules``, ``--controlnet`` and runtime adapter loads bind to the first (default)
  model; the others serve none;
- every other flag applies to each model's engine alike.
"""

from __future__ import annotations

import dataclasses
import re

from diffserve.config.rules import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# What an engine that sleeps for swaps is given as --weights-dir: no update route reaches it
# (the server refuses --enable-weight-updates with several models), so no path is ever read.
NO_WEIGHTS_DIR = "/nonexistent/diffserve-no-weight-updates"


def served_models(config) -> dict[str, str]:
    """``--model`` as name -> path, the default first. One entry without a name is served as
    today, named by --served-model-name or the path itself."""
    entries = [part.strip() for part in config.model.split(",")]
    found: dict[str, str] = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not _NAME.match(name.strip()):
            name, path = entry, entry  # a path or hub id, named by itself
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise ConfigError(f"--model entry {entry!r} is not PATH or NAME=PATH")
        if name in found:
            raise ConfigError(f"--model names {name!r} twice")
        found[name] = path
    if len(found) == 1 and next(iter(found)) == next(iter(found.values())):
        return {config.served_model_name or config.model: config.model}
    if config.served_model_name:
        raise ConfigError("--served-model-name with --model NAME=PATH: the name is the NAME")
    return found


def swaps(config) -> bool:
    """Whether some models may sleep while others serve (--resident-models below their count, or
    a --resident-model-bytes bound)."""
    count = len(served_models(config))
    return count > 1 and (0 < config.resident_models < count or config.resident_model_bytes > 0)


def for_model(config, name: str):
    """The configuration of ``name``'s engine: its path as --model, and the adapters and
    control models only where it is the default model. An engine that may be swapped out
    keeps its weights' sleep and wake (the online-RL control plane's, without its routes)."""
    models = served_models(config)
    first = name == next(iter(models))
    if len(models) == 1:  # one model, named by --model NAME=PATH or as always
        return config if models[name] == config.model else dataclasses.replace(
            config, model=models[name], served_model_name=name)
    sleeps = swaps(config)
    return dataclasses.replace(
        config, model=models[name], served_model_name=name,
        lora_modules=config.lora_modules if first else (),
        controlnet=config.controlnet if first else (),
        enable_lora_runtime_updates=config.enable_lora_runtime_updates and first,
        enable_weight_updates=config.enable_weight_updates or sleeps,
        weights_dir=config.weights_dir or (NO_WEIGHTS_DIR if sleeps else ""))


def problems(config):
    """Settings several models cannot be served with."""
    models = served_models(config)
    if len(models) == 1:
        return
    for flag, names in (("--lora-modules", config.lora_adapters), ("--controlnet",
                                                                   config.control_models)):
        for name in set(names) & set(models):
            yield f"{flag} names {name!r}, which --model names too"
    if config.resident_host_bytes and not swaps(config):
        yield ("--resident-host-bytes bounds the models asleep, and none sleeps: give "
               "--resident-models below the models' count or --resident-model-bytes")
    if config.enable_weight_updates:
        yield ("--enable-weight-updates with several --model: an update would not say which "
               "model it is for; serve the trained model alone")
    if swaps(config):
        why = ("with --resident-models below the models' count or --resident-model-bytes: a swap "
               "sleeps a model's weights into new storage, and wakes them back")
        if config.compile:
            yield f"--compile {why}"
        if config.quantization != "none":
            yield f"--quantization {why}"
        if config.degrees.tp > 1:
            yield f"--tensor-parallel-size {why}"
