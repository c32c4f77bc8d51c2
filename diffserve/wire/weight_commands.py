"""The online-RL control plane's messages: weight updates, and sleeping to give the trainer the
device (docs/rl.md has the routes and the rules).

Frontend -> scheduler: a :class:`WeightCommand`. The scheduler runs it over every executor as
:class:`WeightStep` messages (:mod:`diffserve.scheduler.weight_updates` decides which, when) and each
executor answers a :class:`WeightResult`; the command's own result goes back to the frontend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Commands.
UPDATE, SLEEP, WAKE = "update", "sleep", "wake"
DRAIN_MODE, ABORT_MODE = "drain", "abort"
# An executor's steps: load and check an update without applying it (PREPARE), apply what was
# prepared (COMMIT) or drop it (DISCARD); SYNC: hold exactly these weights (the model's, then each
# source in order), as after a restart or to undo a commit that failed elsewhere.
PREPARE, COMMIT, DISCARD, SYNC = "prepare", "commit", "discard", "sync"
PATH, SHARED = "path", "shared"  # a source: a directory or file; a trainer's shared-memory file
BASE_VERSION = "0"  # the weights --model loads


@dataclass(frozen=True)
class WeightSource:
    """Where an update's tensors are: ``kind`` PATH (a safetensors directory in diffusers'
    layout, or a denoiser state dict: a file, or a directory of shards) or SHARED (a safetensors
    file in shared memory that the server took over from the trainer); ``full``: it holds every
    denoiser weight (so it supersedes every earlier update)."""

    kind: str
    path: str
    full: bool = False


@dataclass(frozen=True)
class WeightCommand:
    """Frontend -> scheduler: an update (``source``, ``mode``, the client's ``version`` or ""),
    a sleep (``level``) or a wake."""

    command_id: str
    op: str
    source: WeightSource | None = None
    mode: str = DRAIN_MODE
    version: str = ""
    level: int = 1


@dataclass(frozen=True)
class WeightStep:
    """Scheduler -> executor: one step of a command (PREPARE, COMMIT, DISCARD, SYNC, SLEEP,
    WAKE). ``sources``: PREPARE's one, or SYNC's whole list; ``version``: what COMMIT or SYNC
    makes current."""

    command_id: str
    step: str
    sources: list[WeightSource] = field(default_factory=list)
    version: str = ""
    level: int = 1


@dataclass(frozen=True)
class WeightResult:
    """Executor -> scheduler (a step's outcome) and scheduler -> frontend (the command's).
    ``status`` is the HTTP one; ``full``: PREPARE found every denoiser weight in the source."""

    command_id: str
    status: int = 200
    error: str = ""
    code: str = ""
    version: str = ""
    applied_at: float | None = None
    sleeping: int = 0
    full: bool = False
