"""Server configuration, declared once.

Every flag of ``diffserve serve`` is a field of :class:`ServerConfig`. The field's metadata
carries its help text and bounds; the CLI, the validation and the docs are generated from it,
so there is a single place where a default or a limit can change.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "shapes"


class ConfigError(ValueError):
    """A configuration value is out of bounds; the message names the flag and the value."""


def option(default: Any, help: str, *, ge: float | None = None, le: float | None = None,
           choices: tuple[str, ...] | None = None, env: str | None = None) -> Any:
    """A config field with its help text and bounds kept beside the default."""
    return field(default=default, metadata={"help": help, "ge": ge, "le": le,
                                            "choices": choices, "env": env})


@dataclass(frozen=True)
class ServerConfig:
    model: str = option(DEFAULT_MODEL,
                        "Model to serve: an embedded model name (see `diffserve models`), a local "
                        "diffusers pipeline directory, or a hub id (needs a network).")
    served_model_name: str = option("", "Name clients use in the `model` field; defaults to --model.")
    host: str = option("127.0.0.1", "Address to bind. The default only accepts local clients.")
    port: int = option(8000, "TCP port for the HTTP API.", ge=0, le=65535)
    dynamic_batch_max_size: int = option(
        8, "Most images in one pipeline call (a request with n images counts n). 1 disables batching.",
        ge=1, le=1024)
    dynamic_batch_delay_ms: float = option(
        8.0, "Longest a batch that is not full waits for more requests, counted from its oldest "
        "request's arrival. A full batch, or any batch once the executor frees up after the delay, "
        "goes at once.", ge=0, le=60_000)
    max_queue_size: int = option(
        0, "Most requests waiting for a batch; more are refused at once with 429 and Retry-After. "
        "0 = unbounded.", ge=0, le=10_000_000)
    request_timeout_s: float = option(
        300.0, "A request that has waited this long without starting is answered 503 and never "
        "runs. 0 = no limit.", ge=0, le=86_400)
    shutdown_timeout_s: float = option(
        30.0, "On SIGTERM/SIGINT, how long to keep finishing queued and running requests before "
        "answering the rest 503 and exiting.", ge=0, le=86_400)
    api_key: str = option("", "If set, /v1/* requires `Authorization: Bearer <key>`; /health and "
                          "/metrics stay open.", env="DIFFSERVE_API_KEY")
    max_body_bytes: int = option(1_048_576, "Largest request body; larger ones get 413.",
                                 ge=1024, le=1 << 30)
    max_n: int = option(10, "Largest `n` (images per request).", ge=1, le=10_000)
    max_inference_steps: int = option(200, "Largest `num_inference_steps` a client may ask for.",
                                      ge=1, le=10_000)
    max_image_side: int = option(2048, "Largest width or height in pixels.", ge=8, le=16_384)
    max_image_pixels: int = option(2048 * 2048, "Largest width x height.", ge=64, le=1 << 28)
    max_prompt_chars: int = option(4000, "Longest prompt or negative prompt, in characters.",
                                   ge=1, le=1_000_000)
    device: str = option("auto", "Torch device for the executor: auto (cuda when available), cpu, "
                         "cuda, cuda:N.")
    dtype: str = option("auto", "Weights dtype: auto (float16 on cuda, float32 on cpu), float32, "
                        "float16, bfloat16.", choices=("auto", "float32", "float16", "bfloat16"))
    torch_threads: int = option(0, "Intra-op threads for torch in the executor; 0 = torch's default "
                                "(OMP_NUM_THREADS if set, else the cores).",
                                ge=0, le=1024)
    startup_timeout_s: float = option(600.0, "Longest wait for the model to load before giving up.",
                                      ge=1, le=86_400)
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

    def __repr__(self) -> str:  # keep the API key out of logs
        shown = dataclasses.replace(self, api_key="***") if self.api_key else self
        return "ServerConfig(" + ", ".join(
            f"{f.name}={getattr(shown, f.name)!r}" for f in dataclasses.fields(self)) + ")"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

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
                merged[f.name] = values[f.name]
            elif env and os.environ.get(env):
                merged[f.name] = parse_value(f, os.environ[env])
        return cls(**merged)


def parse_value(f: dataclasses.Field, text: str) -> Any:
    """Convert a string to the field's type (the type of its default)."""
    kind = type(f.default)
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"--{f.name.replace('_', '-')}={text!r} is not a valid {kind.__name__}") from None
