"""Server configuration, declared once.

Every flag of ``diffserve serve`` is a field of :class:`ServerConfig`. The field's metadata
carries its help text and bounds; the CLI, the validation and the docs are generated from it,
so there is a single place where a default or a limit can change.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from typing import Any

from diffserve.config import rules as config_rules
from diffserve.config.fields import option, parse_value  # noqa: F401 - parse_value: the CLI's
from diffserve.config.rules import ConfigError, named_paths
from diffserve.config.speed import SpeedOptions
from diffserve.policies import QUEUE_POLICIES, SET_POLICIES
from diffserve.config import executors, models
from diffserve.config.executors import Degrees

DEFAULT_MODEL = "shapes"
NO_ADAPTER = "none"  # how the metrics name requests without an adapter
OTHER_ADAPTERS = "other"  # and adapters past the label bound
RESERVED_ADAPTER_NAMES = (NO_ADAPTER, OTHER_ADAPTERS)


@dataclass(frozen=True)
class ServerConfig(SpeedOptions):
    model: str = option(DEFAULT_MODEL,
                        "Model to serve: an embedded model name (see `diffserve models`), a local "
                        "diffusers pipeline directory, `random:NAME`, or a hub id (needs a "
                        "network). Repeat it as NAME=PATH to serve several, picked by the "
                        "request's model field; the first is the default (docs/models.md).",
                        metavar="[NAME=]PATH", repeat=True)
    served_model_name: str = option("", "Name clients use in the `model` field; defaults to --model.")
    resident_models: int = option(
        0, "Several --model: most models awake at once; the others sleep in host memory and are "
        "swapped in (a measured sleep and wake) when their requests come. 0 = all.", ge=0, le=64)
    resident_model_bytes: int = option(
        0, "Several --model: most weight bytes the awake models hold together. 0 = no bound.",
        ge=0, le=1 << 50)
    resident_host_bytes: int = option(
        0, "Several --model: most weight bytes the sleeping models keep in host memory; a model "
        "put to sleep past it goes to disk (reloaded from its files at its wake). 0 = no bound.",
        ge=0, le=1 << 50)
    max_swap_wait_ms: float = option(
        5000.0, "Several --model: longest a request waits for its model to be swapped in while "
        "every resident model is busy; past it the busiest resident model's queue waits "
        "instead (its running work finishes first).", ge=0, le=3_600_000)
    host: str = option("127.0.0.1", "Address to bind. The default only accepts local clients.")
    port: int = option(8000, "TCP port for the HTTP API.", ge=0, le=65535)
    dynamic_batch_max_size: int = option(
        8, "Most images in one pipeline call (a request with n images counts n). 1 disables batching.",
        ge=1, le=1024)
    dynamic_batch_delay_ms: float = option(
        8.0, "Longest a batch that is not full waits for more requests, counted from its oldest "
        "request's arrival. A full batch, or any batch once the executor frees up after the delay, "
        "goes at once.", ge=0, le=60_000)
    max_batch_cost: float = option(
        0.0, "Most cost one denoiser forward carries, in rows at the model's native size (an "
        "image is one row, two with classifier-free guidance, times its pixels over the native "
        "size's). 0 = --dynamic-batch-max-size native images at the model's default guidance. A "
        "request whose single image costs more is refused (400); larger n is split.",
        ge=0, le=1_000_000)
    max_running_cost: float = option(
        0.0, "Step mode: most cost an executor holds across its running sets (one per size). 0 = "
        "twice --max-batch-cost.", ge=0, le=1_000_000)
    scheduling_policy: str = option(
        "fcfs", "Order of the waiting queue; its first request is always in the next batch or "
        "admission. fcfs: first come, first served. sjf: shortest job first (images x steps x "
        "cost), which lowers the mean wait of mixed traffic at the expense of long requests. "
        "priority: by each request's priority class (lower first; the request's `priority` "
        "field or its API key's), aging with --priority-aging-s; in step mode a request that "
        "cannot start pauses running requests of worse classes at the next step.",
        choices=tuple(QUEUE_POLICIES))
    priority_aging_s: float = option(
        30.0, "--scheduling-policy priority: a waiting request's priority improves by one class "
        "every this many seconds, so nothing starves (a request of class p is passed only by "
        "requests of class q that arrive within (p - q) x this after it). 0 = strict priority.",
        ge=0, le=86_400)
    size_mixing: str = option(
        "auto", "Step mode: whether requests of different sizes share one denoiser forward, "
        "their rows padded and masked, where the family's transformer takes them (auto; "
        "docs/batching.md, \"Sizes in one forward\"); off: one running set per size.",
        choices=("auto", "off"))
    set_policy: str = option(
        "auto", "Step mode: which running set (one per size) the next denoising step advances. "
        "oldest: the set holding the request that arrived first (request mode's order, with "
        "joins; the lowest p50 and p99 measured on mixed sizes). fair: every request loses about "
        "the same time to the others (processor sharing; a new size starts at the next step). "
        "srpt: the set whose nearest completion comes soonest, unless a request has lost more "
        "than its own processing time (then its set). auto: oldest, or fair with "
        "--scheduling-policy priority (so that a better class's new size does not wait for "
        "older requests of a worse one).",
        choices=("auto", *SET_POLICIES))
    batching_mode: str = option(
        "auto", "How requests share the model. request: one batched pipeline call per batch, for "
        "any diffusers text-to-image or video pipeline. step: requests join and leave a running "
        "batch between denoising steps, for the families the step engine knows (`diffserve "
        "models`, docs/models.md); a task whose start-up check fails in step mode runs in "
        "request mode alone. auto: step where the pipeline's family is known, else request.",
        choices=("auto", "step", "request"))
    skip_startup_check: bool = option(
        False, "Skip the start-up checks: a two-step request of every task through its plain "
        "pipeline (a task that fails is not offered) and, in step mode, through the step engine "
        "(a task whose image differs runs in request mode; --batching-mode step refuses to start "
        "only where no task can run in step mode).")
    data_parallel_size: int = option(
        0, "Executors fed by the one queue: each one device, or one parallel group of "
        "--ulysses-degree x --ring-degree x --cfg-parallel-size (or --tensor-parallel-size x "
        "--cfg-parallel-size) devices. 0 = as many as --devices holds, else as many groups as "
        "the visible GPUs hold where a degree above 1 is given, else 1.", ge=0, le=256)
    devices: str = option(
        "", "Comma-separated torch devices, one per executor (e.g. cuda:0,cuda:1), or one per rank "
        "of every group, group after group. Unset: every executor uses --device, where auto "
        "spreads executors over the visible GPUs.")
    ulysses_degree: int = option(
        1, "Ranks of a group that split each forward's sequence with Ulysses attention "
        "(diffusers' context parallelism: an all-to-all of heads and tokens). Needs a "
        "denoiser with a context-parallel plan (Flux, FLUX.2, Qwen-Image, Wan).", ge=1, le=64)
    ring_degree: int = option(
        1, "Ranks of a group that split each forward's sequence with ring attention (diffusers' "
        "context parallelism; GPUs only: the CPU's attention returns no log-sum-exp).",
        ge=1, le=64)
    cfg_parallel_size: int = option(
        1, "2: a group's ranks split in two, the unconditional rows of every forward on one half "
        "and the conditional ones on the other, joined by one all-gather. For families that "
        "run classifier-free guidance (not Flux, FLUX.2 [dev]).", ge=1, le=2)
    tensor_parallel_size: int = option(
        1, "Ranks of a group that shard the denoiser's weights (diffusers' tensor parallelism; "
        "weights are sharded as they load; GPUs only). Not with --ulysses-degree or "
        "--ring-degree above 1.", ge=1, le=64)
    collective_timeout_s: float = option(
        300.0, "A group whose ranks wait this long in a collective (a rank hangs or died) is "
        "restarted whole; its requests are answered.", ge=1, le=86_400)
    max_queue_size: int = option(
        0, "Most requests waiting for a batch; more are refused at once with 429 and Retry-After. "
        "0 = unbounded.", ge=0, le=10_000_000)
    request_timeout_s: float = option(
        300.0, "A request that has waited this long without starting is answered 503 and never "
        "runs. 0 = no limit.", ge=0, le=86_400)
    shutdown_timeout_s: float = option(
        30.0, "On SIGTERM/SIGINT, how long to keep finishing queued and running requests before "
        "answering the rest 503 and exiting.", ge=0, le=86_400)
    api_key: tuple[str, ...] = option(
        (), "API keys, each KEY or KEY:PRIORITY (repeatable; in the environment, comma-separated): "
        "if set, /v1/* requires `Authorization: Bearer <key>`; /health and /metrics stay open. A "
        "key's priority class (--scheduling-policy priority) is its requests' default and the best "
        "they may ask for.", env="DIFFSERVE_API_KEY", metavar="KEY[:PRIORITY]")
    max_body_bytes: int = option(1_048_576, "Largest request body; larger ones get 413.",
                                 ge=1024, le=1 << 30)
    max_n: int = option(10, "Largest `n` (images per request).", ge=1, le=10_000)
    max_inference_steps: int = option(200, "Largest `num_inference_steps` a client may ask for.",
                                      ge=1, le=10_000)
    max_image_side: int = option(2048, "Largest width or height in pixels.", ge=8, le=16_384)
    max_image_pixels: int = option(2048 * 2048, "Largest width x height.", ge=64, le=1 << 28)
    max_prompt_chars: int = option(4000, "Longest prompt or negative prompt, in characters.",
                                   ge=1, le=1_000_000)
    max_upload_bytes: int = option(16 << 20, "Largest /v1/images/edits body (the image, the mask "
                                   "and the form fields together); larger ones get 413.",
                                   ge=1024, le=1 << 31)
    max_input_pixels: int = option(4096 * 4096, "Largest decoded input image or mask, width x "
                                   "height; checked from the file's header before it is decoded.",
                                   ge=64, le=1 << 30)
    device: str = option("auto", "Torch device of every executor when --devices is unset: auto "
                         "(executor i on GPU i modulo the visible GPUs, else cpu), cuda (the "
                         "same spread over the GPUs), cuda:N (all on GPU N), cpu.")
    dtype: str = option("auto", "Weights dtype: auto (on a GPU the dtype the model's family is "
                        "published in: float16 for SD 1.x/2.x and SDXL, bfloat16 for the others "
                        "and for pipelines the step engine does not know, float16 where the GPU "
                        "has no bfloat16; float32 on the CPU), float32, float16, bfloat16.",
                        choices=("auto", "float32", "float16", "bfloat16"))
    torch_threads: int = option(0, "Intra-op threads for torch in each executor; 0 = torch's "
                                "default (OMP_NUM_THREADS if set, else the cores), shared out "
                                "between the executors when several run on the CPU.",
                                ge=0, le=1024)
    startup_timeout_s: float = option(600.0, "Longest wait for the model to load before giving up.",
                                      ge=1, le=86_400)
    stages: str = option(
        "auto", "Step mode: where prompts are encoded, input images VAE-encoded and finished "
        "images decoded. on: on a thread of its own each (the encode and the decode stage; on "
        "CUDA with a stream of its own), beside the step loop, so that the denoiser never waits "
        "for them; off: on the step loop, between two steps. auto: on on a GPU (off in a parallel "
        "group, whose ranks must admit at the same step, and on a CPU, where a stage takes "
        "cores from the loop).", choices=("auto", "on", "off"))
    prompt_cache_bytes: int = option(
        512 << 20, "Step mode: most bytes of prompt encodings kept for the next request that "
        "asks for the same prompt, negative prompt, adapters (by version) and input images "
        "(least recently used first out). 0 = none kept.", ge=0, le=1 << 40)
    offload: str = option(
        "none", "Keep components in host memory and bring them to the device for their use "
        "(diffusers' group offloading): layer streams the denoiser's blocks onto the device one "
        "block ahead of use; model brings each offloaded component whole for each use.",
        choices=("none", "model", "layer"))
    offload_components: tuple[str, ...] = option(
        (), "--offload: which components, of dit (the denoisers), text_encoder, vae. Unset: dit "
        "for layer, all three for model.")
    text_encoder_device: str = option(
        "", "Put the text encoders on this device (cpu, cuda:N), the same for every executor; "
        "unset: the executor's own.")
    vae_device: str = option(
        "", "Put the VAE on this device (cpu, cuda:N), the same for every executor; unset: the "
        "executor's own.")
    vae_tiling: str = option(
        "off", "Decode and encode in tiles: on always; auto from 2048x2048 pixels (times the "
        "frames of a video) up; off keeps every image equal to plain diffusers.",
        choices=("off", "on", "auto"))
    vae_tile_size: int = option(
        0, "--vae-tiling: a tile's side in pixels (0: the VAE's own).", ge=0, le=8192)
    gpu_memory_utilization: float = option(
        0.0, "The share of the device's memory the executor may use (weights, offload buffers, "
        "step caches and the running sets' activations); running sets are admitted under it. "
        "0: no memory budget.", ge=0, le=1)
    device_memory_bytes: int = option(
        0, "The same budget in bytes (works on a CPU too); 0: none. With both, the smaller.",
        ge=0, le=1 << 50)
    lora_modules: tuple[str, ...] = option(
        (), "LoRA adapters to serve, each NAME=PATH: a .safetensors file or a directory as "
        "diffusers' save_lora_weights writes it (kohya/A1111 layouts too, where diffusers converts "
        "them). Clients pick one with model=NAME, or stack several with the loras field. With "
        "several --model: the first model's.",
        metavar="NAME=PATH")
    max_loras: int = option(8, "Most LoRA adapters resident in each executor; the least recently "
                            "used one that no running request uses is unloaded for another.",
                            ge=1, le=1024)
    max_lora_rank: int = option(128, "Largest rank of a LoRA adapter (larger ones are refused).",
                                ge=1, le=4096)
    max_loras_per_request: int = option(4, "Most adapters one request may stack.", ge=1, le=64)
    controlnet: tuple[str, ...] = option(
        (), "ControlNet models to serve, each NAME=PATH: a diffusers ControlNet directory, a hub "
        "id, or an embedded one (`diffserve models`). Requests stack them by name in their "
        "controls field (docs/controlnet.md). With several --model: the first model's.", metavar="NAME=PATH")
    max_controls_per_request: int = option(4, "Most controls one request may stack.",
                                           ge=1, le=16)
    enable_lora_runtime_updates: bool = option(
        False, "Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (API key required "
        "where one is set; paths only inside --lora-dir).")
    lora_dir: str = option("", "Directory that runtime-loaded adapters must lie in (symlinks "
                           "resolved); required with --enable-lora-runtime-updates.")
    enable_weight_updates: bool = option(
        False, "The online-RL control routes: POST /v1/update_weights (paths only inside "
        "--weights-dir, or tensors in shared memory), /v1/sleep, /v1/wake_up and GET "
        "/v1/is_sleeping (API key required where one is set).")
    weights_dir: str = option("", "Directory that weight updates from disk must lie in (symlinks "
                              "resolved); required with --enable-weight-updates.")
    reject_while_sleeping: bool = option(
        False, "While the server sleeps (POST /v1/sleep), answer new requests 503 at once instead "
        "of holding them until it wakes (or --request-timeout-s).")
    video_dir: str = option(
        "", "Video models: the directory of the video jobs (their table in SQLite, MP4s, "
        "thumbnails, sprite sheets); a restart with the same directory keeps every job. Unset: "
        "a temporary directory removed at exit.")
    video_ttl_s: float = option(
        86_400.0, "Video models: a finished job's files are removed this long after it finished "
        "(its expires_at); 0 = never.", ge=0, le=365 * 86_400)
    max_video_jobs: int = option(
        64, "Video models: most queued video jobs; more get 429.", ge=1, le=1_000_000)
    max_video_frames: int = option(
        257, "Video models: largest frame count a job may ask for.", ge=1, le=10_000)
    allowed_image_hosts: tuple[str, ...] = option(
        (), "Hosts whose http(s) image URLs a JSON edit may name, fetched by the server (at most "
        "--max-upload-bytes, 10 s each); * allows any. Unset: data URLs only. A URL makes the "
        "server reach hosts the client names (SSRF): list only hosts meant for it.")
    image_dir: str = option(
        "", "Where response_format=url images and image jobs are kept (a local directory, or an "
        "fsspec URL such as s3://bucket/prefix where fsspec is installed). Unset: a temporary "
        "directory removed at exit; jobs then end with the server.")
    image_ttl_s: float = option(
        3600.0, "A url image, and a finished image job, is removed this long after it was made.",
        ge=1, le=365 * 86_400)
    max_image_store_bytes: int = option(
        1 << 30, "Most bytes of url images kept; past it the oldest go first.", ge=1 << 20,
        le=1 << 50)
    webhook_secret: str = option(
        "", "Signs image jobs' webhooks (Standard Webhooks: webhook-signature is v1, and the "
        "base64 HMAC-SHA256 of id.timestamp.body); a whsec_ prefix is base64. Unset: webhooks "
        "are refused.", env="DIFFSERVE_WEBHOOK_SECRET")
    allowed_webhook_hosts: tuple[str, ...] = option(
        (), "Hosts an image job's webhook may name. Unset: any host. The server posts to the "
        "host the client names (SSRF): narrow it where the server reaches private hosts.")
    log_level: str = option("info", "Log level.",
                            choices=("debug", "info", "warning", "error", "critical"))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            meta = f.metadata
            flag = "--" + f.name.replace("_", "-")
            if meta.get("ge") is not None and value < meta["ge"]:
                raise ConfigError(f"{flag}={value!r} is below the minimum {meta['ge']}")
            if meta.get("le") is not None and value > meta["le"]:
                raise ConfigError(f"{flag}={value!r} is above the maximum {meta['le']}")
            if meta.get("choices") and value not in meta["choices"]:
                raise ConfigError(f"{flag}={value!r} is not one of {', '.join(meta['choices'])}")
        problem = next(itertools.chain(config_rules.problems(self), models.problems(self)), None)
        if problem is not None:
            raise ConfigError(problem)

    def __repr__(self) -> str:  # keep the API keys and the webhook secret out of logs
        shown = dataclasses.replace(self, api_key=("***",) if self.api_key else (),
                                    webhook_secret="***" if self.webhook_secret else "")
        return "ServerConfig(" + ", ".join(
            f"{f.name}={getattr(shown, f.name)!r}" for f in dataclasses.fields(self)) + ")"

    @property
    def model_name(self) -> str:
        """The name of the (first, default) model."""
        return next(iter(self.served_models))

    @property
    def served_models(self) -> dict[str, str]:
        """Each model's name -> path, the default first (:mod:`diffserve.config.models`)."""
        return models.served_models(self)

    def for_model(self, name: str) -> ServerConfig:
        """The configuration one model's engine runs with (:func:`diffserve.config.models.for_model`)."""
        return models.for_model(self, name)

    @property
    def lora_adapters(self) -> dict[str, str]:
        """--lora-modules as name -> path, in the order given."""
        return named_paths(self.lora_modules, "--lora-modules", RESERVED_ADAPTER_NAMES,
                           "the metrics' name for requests without an adapter, or for adapters "
                           "past their bound")

    @property
    def control_models(self) -> dict[str, str]:
        """--controlnet as name -> path, in the order given."""
        return named_paths(self.controlnet, "--controlnet")

    @property
    def api_keys(self) -> dict[str, int | None]:
        """--api-key as key -> its priority class (:func:`diffserve.config.rules.api_keys`)."""
        return config_rules.api_keys(self.api_key)

    @property
    def offloaded(self) -> tuple[str, ...]:
        """The components --offload keeps in host memory."""
        if self.offload == "none":
            return ()
        return self.offload_components or (("dit",) if self.offload == "layer" else
                                           ("dit", "text_encoder", "vae"))

    @property
    def set_policy_name(self) -> str:
        """--set-policy, ``auto`` resolved."""
        if self.set_policy != "auto":
            return self.set_policy
        return "fair" if self.scheduling_policy == "priority" else "oldest"

    @property
    def serves_adapters(self) -> bool:
        return bool(self.lora_modules or self.enable_lora_runtime_updates)

    @property
    def degrees(self) -> Degrees:
        """The parallel group's shape (its ``size``: ranks per executor, 1 without a group)."""
        return Degrees.of(self)

    @property
    def num_executors(self) -> int:
        """Executors fed by the queue: single devices, or parallel groups."""
        try:
            return executors.num_executors(self)
        except executors.TopologyError as error:
            raise ConfigError(str(error)) from None

    def executor_devices(self) -> list[str]:
        """Each executor's device, or a group's devices
        (:func:`diffserve.config.executors.executor_devices`)."""
        try:
            return executors.executor_devices(self)
        except executors.TopologyError as error:
            raise ConfigError(str(error)) from None

    @property
    def dynamic_batch_delay_s(self) -> float:
        return self.dynamic_batch_delay_ms / 1000.0

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> "ServerConfig":
        """Build from CLI values; a flag left unset falls back to its environment variable, if any."""
        merged: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            env = f.metadata.get("env")
            if values.get(f.name) is not None:
                value = values[f.name]
                merged[f.name] = (tuple(value) if isinstance(f.default, tuple) else
                                  ",".join(value) if f.metadata.get("repeat")
                                  and not isinstance(value, str) else value)
            elif env and os.environ.get(env):
                merged[f.name] = parse_value(f, os.environ[env])
        return cls(**merged)
