"""The runtime LoRA endpoints' rules: which files a request may name, and how an engine answer
becomes HTTP.

A request body never names an arbitrary file: ``lora_path`` (absolute, or relative to
``--lora-dir``) must resolve, symlinks followed, to a path inside ``--lora-dir``, and so must
every file inside it where it is a directory; anything else is 403 (a path outside is refused
before the file system is asked whether it exists).
"""

from __future__ import annotations

from pathlib import Path

from diffserve.config.flags import RESERVED_ADAPTER_NAMES
from diffserve.errors import APIError, forbidden, invalid_request, model_not_found
from diffserve.wire.protocol import AdapterResult


def path_inside(path: str, root_dir: str, param: str = "lora_path",
                flag: str = "--lora-dir") -> str:
    """``path`` resolved, if it lies inside ``root_dir``; 403 otherwise, 400 if missing.
    ``param`` and ``flag``: the body field and the server flag, as the errors name them."""
    root = Path(root_dir).resolve()
    candidate = Path(path)
    resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if not resolved.is_relative_to(root):
        raise forbidden(f"{param} must lie inside the server's {flag} ({root_dir}); "
                        f"{path!r} does not", param)
    if not resolved.exists():
        raise invalid_request(f"{param} {path!r} does not exist in {flag}", param,
                              "invalid_value")
    if resolved.is_dir():  # the loader reads files inside it: each must stay inside too
        for entry in resolved.rglob("*"):
            if not entry.resolve().is_relative_to(root):
                raise forbidden(f"{param} {path!r} holds {entry.name!r}, a link to a file "
                                f"outside the server's {flag} ({root_dir})", param)
    return str(resolved)


def check_name(name: str, served: str) -> None:
    if name == served or name in RESERVED_ADAPTER_NAMES:
        raise invalid_request(f"lora_name {name!r} is reserved (the base model's name, or one the "
                              "metrics use for no adapter or for adapters past their bound)", "lora_name",
                              "invalid_value")


def raise_for(result: AdapterResult, name: str, served: str, adapters) -> None:
    """An engine's failed answer as the client's error."""
    if result.status == 200:
        return
    if result.status == 404:
        raise model_not_found(name, served, adapters, "lora_name")
    if result.status == 400:
        raise invalid_request(result.error, "lora_path", "invalid_lora_adapter")
    raise APIError(result.error, None, "adapter_update_failed", result.status, "server_error")
