"""The tensor transport of weight updates on one host: the trainer writes its state dict as a
safetensors file into the host's shared-memory directory (``/dev/shm``: memory, never a disk)
and names the file in ``POST /v1/update_weights``; the server takes the file over (renames it
into a directory of its own on the same file system, so the trainer can neither change nor
delete it any more), and deletes it once a later update supersedes it or the server stops. The
file is kept meanwhile because an executor that restarts applies the current weights again.

On a GPU host the same path works: the trainer's tensors go through host memory once, and each
executor copies them to its device.
"""

from __future__ import annotations

import os
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Any

SHARED_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def write(tensors: dict[str, Any], directory: Path = SHARED_DIR) -> str:
    """``tensors`` (name -> torch tensor, any device) as a file in ``directory``; its name, for
    ``{"tensors": {"shared_memory": name}}``."""
    from safetensors.torch import save_file

    name = f"diffserve-update-{uuid.uuid4().hex}.safetensors"
    partial = directory / f".{name}.partial"
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(partial))
    os.replace(partial, directory / name)  # whole, or not there at all
    return name


class NotShared(ValueError):
    """A name that is not a file this process may take over."""


def take_over(name: str, into: str) -> str:
    """Move the trainer's file ``name`` into ``into``; its new path."""
    source = SHARED_DIR / name
    try:
        info = source.lstat()
    except FileNotFoundError:
        raise NotShared(f"no file {name!r} in {SHARED_DIR}") from None
    if not stat.S_ISREG(info.st_mode):
        raise NotShared(f"{name!r} in {SHARED_DIR} is not a regular file")
    if info.st_uid != os.getuid():
        raise NotShared(f"{name!r} in {SHARED_DIR} belongs to another user")
    target = Path(into) / name
    os.replace(source, target)
    return str(target)


def shared_directory(prefix: str = "diffserve-weights-") -> str:
    """A directory of the server's own beside the trainers' files (the same file system)."""
    return tempfile.mkdtemp(prefix=prefix, dir=SHARED_DIR)
