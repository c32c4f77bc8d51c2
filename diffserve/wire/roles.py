"""How each request field takes part in batching, declared on the field itself, and which roles
each batching mode can vary within one forward. The batch key follows from these: no list
of field names exists anywhere."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from functools import cache
from typing import Any

# How a request field takes part in batching:
SHAPE = "shape"              # fixes tensor shapes: equal for every sample of a forward, in any mode
SIZE = "size"                # an image's size: its token count, which a mixing step engine pads
CALL = "call"                # one value per pipeline call; the step engine varies it per sample
SAMPLE = "sample"            # may differ between the samples of one forward, in any mode
BOOKKEEPING = "bookkeeping"  # identifies or tracks the request; never affects what is computed
ROLES = (SHAPE, SIZE, CALL, SAMPLE, BOOKKEEPING)

REQUEST_MODE = "request"
STEP_MODE = "step"
# The step engine over a family whose forward carries rows of different sizes (a transformer's
# rows are token sequences, padded to the longest): not a batching mode of its own, the key of
# the tasks the step engine mixes sizes in (ModelInfo.mixed_sizes).
MIXED_STEP_MODE = "step-mixed"
# Which roles each batching mode can vary inside one batch (request mode) or one running set
# (step mode). The step engine runs every sample on its own noise schedule, so CALL fields
# (steps, guidance, strength, task) may differ there.
VARIES_PER_SAMPLE: dict[str, frozenset[str]] = {
    REQUEST_MODE: frozenset({SAMPLE}),
    STEP_MODE: frozenset({SAMPLE, CALL}),
    MIXED_STEP_MODE: frozenset({SAMPLE, CALL, SIZE}),
}

def _role(role: str, default: Any) -> Any:
    return field(default=default, metadata={"batch": role})


def shape(default: Any = dataclasses.MISSING) -> Any:
    return _role(SHAPE, default)


def call(default: Any = dataclasses.MISSING) -> Any:
    return _role(CALL, default)


def sample(default: Any = dataclasses.MISSING) -> Any:
    return _role(SAMPLE, default)


def size(default: Any = dataclasses.MISSING) -> Any:
    return _role(SIZE, default)


def bookkeeping(default: Any = dataclasses.MISSING) -> Any:
    return _role(BOOKKEEPING, default)


@cache
def fields_with_role(cls: type, role: str) -> tuple[str, ...]:
    names = []
    for f in dataclasses.fields(cls):
        declared = f.metadata.get("batch")
        if declared not in ROLES:
            raise TypeError(f"{cls.__name__}.{f.name} does not declare its batching role")
        if declared == role:
            names.append(f.name)
    return tuple(names)


@cache
def batch_key_fields(cls: type, mode: str) -> tuple[str, ...]:
    """The fields two requests must agree on to share a forward in ``mode``."""
    varies = VARIES_PER_SAMPLE[mode] | {BOOKKEEPING}
    return tuple(name for role in ROLES if role not in varies
                 for name in fields_with_role(cls, role))


def key_mode(mode: str, mixes_sizes: bool) -> str:
    """The mode a request's batch key is computed in: ``mode``, or the step engine's mixing
    key where the step engine runs the request's task with sizes mixed."""
    return MIXED_STEP_MODE if mode == STEP_MODE and mixes_sizes else mode
