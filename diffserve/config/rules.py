"""The flags of :class:`~diffserve.config.flags.ServerConfig` against each other: every rule that
involves more than one flag, each said once. :func:`problems` yields what is wrong, in the order
the rules are written; the configuration raises the first (naming the flags and the reason)."""

from __future__ import annotations

from typing import Iterator

from diffserve.builders import random as random_weights
from diffserve.policies import QUEUE_POLICIES
from diffserve.config.executors import device_list

OFFLOADABLE = ("dit", "text_encoder", "vae")


class ConfigError(ValueError):
    """A configuration value is out of bounds; the message names the flag and the value."""


def named_paths(entries: tuple[str, ...], flag: str, reserved: tuple[str, ...] = (),
                why_reserved: str = "") -> dict[str, str]:
    """``NAME=PATH`` entries as name -> path, in the order given (--lora-modules,
    --controlnet)."""
    found: dict[str, str] = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path or any(c.isspace() for c in name):
            raise ConfigError(f"{flag} entry {entry!r} is not NAME=PATH")
        if name in found:
            raise ConfigError(f"{flag} names {name!r} twice")
        if name in reserved:
            raise ConfigError(f"{flag}: {name!r} is reserved ({why_reserved})")
        found[name] = path
    return found


def problems(config) -> Iterator[str]:
    for rules in (_parallel, _memory, _devices, _serving, _speed):
        yield from rules(config)


def _parallel(config) -> Iterator[str]:
    d, size = config.degrees, config.degrees.size
    if d.tp > 1 and d.context:
        yield (f"--tensor-parallel-size={d.tp} with --ulysses-degree={d.ulysses} --ring-degree="
               f"{d.ring}: diffusers shards a model either by tensor or by context, not both")
    if size > 1 and config.batching_mode == "request":
        yield (f"--batching-mode request with a parallel group ({size} ranks): a group runs the "
               "step engine, whose every step its leader plans for all ranks")
    if size > 1 and config.compile:
        yield ("--compile with a parallel group: compiled blocks have not been verified under "
               "diffusers' parallel hooks")
    if d.tp > 1:
        for flag, given in (("--lora-modules", config.serves_adapters),
                            ("--quantization", config.quantization != "none")):
            if given:
                yield (f"--tensor-parallel-size with {flag}: diffusers' tensor parallelism "
                       "refuses PEFT layers and quantized weights")
        if config.enable_weight_updates:
            yield ("--tensor-parallel-size with --enable-weight-updates: an update holds whole "
                   "tensors, and each rank holds a shard of them")
    if size > 1 and config.stages == "on":
        yield ("--stages on with a parallel group: every rank must admit a request at the same "
               "step, which encoding beside each rank's loop cannot promise")
    if config.controlnet and (d.context or d.tp > 1):
        yield ("--controlnet with --ulysses-degree, --ring-degree or --tensor-parallel-size: a "
               "control model runs whole on each rank, and its residuals cover every token, "
               "which the group splits between ranks (CFG parallelism works)")
    if d.cfg > 1 and config.step_cache != "off":
        yield ("--cfg-parallel-size 2 with --step-cache: a forward's rows are split between "
               "ranks, each image's cache decision needs all of its rows")


def _memory(config) -> Iterator[str]:
    unknown = [c for c in config.offload_components if c not in OFFLOADABLE]
    if unknown:
        yield f"--offload-components {unknown[0]!r} is not one of {', '.join(OFFLOADABLE)}"
    if config.offload_components and config.offload == "none":
        yield "--offload-components needs --offload model or layer"
    if config.offload == "none":
        return
    for flag, given, why in (
            ("--compile", config.compile, "compiled blocks would be traced with the offloading "
             "hooks' moves inside them"),
            ("--quantization", config.quantization != "none", "torchao's quantized weights are "
             "not moved by diffusers' group offloading"),
            ("a parallel group", config.degrees.size > 1, "each rank would stream its own copy"),
            ("--step-cache", config.step_cache != "off", "the step cache runs the denoiser's "
             "blocks one by one, outside the hooks that bring them onto the device"),
            ("LoRA adapters", config.serves_adapters and "dit" in config.offloaded,
             "each step gathers the adapters' weights on the device, which offloading moves away")):
        if given:
            yield f"--offload {config.offload} with {flag}: {why}"


def _devices(config) -> Iterator[str]:
    listed, size = device_list(config), config.degrees.size
    if listed and config.data_parallel_size and len(listed) != config.data_parallel_size * size:
        yield (f"--devices={config.devices!r} names {len(listed)} devices but "
               f"--data-parallel-size={config.data_parallel_size}"
               + (f" groups of {size} ranks need {config.data_parallel_size * size}"
                  if size > 1 else ""))
    if listed and len(listed) % size:
        yield (f"--devices={config.devices!r} names {len(listed)} devices, not a multiple of the "
               f"group size {size}")
    if listed and not all(listed):
        yield f"--devices={config.devices!r} has an empty entry"


def _serving(config) -> Iterator[str]:
    controls = config.control_models  # checks each NAME=PATH
    if config.model_name in controls:
        yield f"--controlnet names a control model {config.model_name!r}, the served model's own name"
    for path in config.served_models.values():
        if random_weights.is_random(path):
            try:
                random_weights.parse(path)
            except random_weights.RandomModelError as error:
                yield str(error)
    if config.model_name in config.lora_adapters:  # which also checks each NAME=PATH
        yield (f"--lora-modules names an adapter {config.model_name!r}, the served model's own "
               "name")
    if config.max_loras < config.max_loras_per_request:
        yield (f"--max-loras={config.max_loras} is below --max-loras-per-request="
               f"{config.max_loras_per_request}: a request's adapters must fit at once")
    keys = config.api_keys  # checks each KEY[:PRIORITY]
    if (any(p is not None for p in keys.values())
            and not QUEUE_POLICIES[config.scheduling_policy].uses_priority):
        yield ("--api-key gives a priority, which only --scheduling-policy priority uses (it is "
               f"{config.scheduling_policy!r})")
    if config.step_cache != "off" and config.batching_mode == "request":
        yield (f"--step-cache={config.step_cache} decides per request between denoising steps, "
               "which only step mode has; not with --batching-mode request")
    if config.compile and config.serves_adapters:
        yield ("--compile does not take LoRA adapters (--lora-modules, "
               "--enable-lora-runtime-updates): each forward's per-row adapter plan would "
               "recompile the blocks")
    if config.cache_threshold and config.step_cache == "off":
        yield f"--cache-threshold={config.cache_threshold!r} needs --step-cache first-block"
    if config.enable_lora_runtime_updates and not config.lora_dir:
        yield ("--enable-lora-runtime-updates needs --lora-dir, the one directory runtime-loaded "
               "adapters may come from")
    if config.enable_weight_updates and not config.weights_dir:
        yield ("--enable-weight-updates needs --weights-dir, the one directory weight updates "
               "from disk may come from")
    if config.enable_weight_updates and config.compile:
        yield ("--enable-weight-updates with --compile: a sleep puts the weights in new storage, "
               "which graphs captured over the old would not see")
    if config.enable_weight_updates and config.quantization != "none":
        yield (f"--enable-weight-updates with --quantization {config.quantization}: an update "
               "would have to be quantized again as it is applied, which is not done; serve the "
               "trained model unquantized")


def _speed(config) -> Iterator[str]:
    compiled = (("--compile-rows", config.compile_rows != "exact"),
                ("--cuda-graphs", config.cuda_graphs != "off"))
    for flag, given in compiled:
        if given and not config.compile:
            yield f"{flag} shapes what --compile compiles; it needs --compile"
    if config.quantization_scope != "auto" and config.quantization == "none":
        yield f"--quantization-scope {config.quantization_scope} needs --quantization"


def api_keys(entries) -> dict[str, int | None]:
    """--api-key entries as key -> its priority class (None: the request's own, default 0). A
    key whose last ':'-separated part is an integer gives that priority."""
    keys: dict[str, int | None] = {}
    for entry in entries:
        key, sep, tail = entry.rpartition(":")
        priority = None
        if sep and key and tail.lstrip("-").isdigit():
            priority = int(tail)
        else:
            key = entry
        if not key or any(c.isspace() for c in key):
            raise ConfigError(f"--api-key entry {entry!r} is not KEY or KEY:PRIORITY")
        keys[key] = priority
    return keys
