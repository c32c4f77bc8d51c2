"""The bounds of the body fields the images and videos APIs share, declared once as types, so
that the two bodies cannot drift apart (each still describes a field in its own words)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from diffserve.wire.request import SEED_MAX

PRIORITY_LIMIT = 1_000_000
GUIDANCE_LIMIT = 100
MAX_USER_CHARS = 256

Prompt = Annotated[str, Field(min_length=1)]
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
Steps = Annotated[int, Field(ge=1)]
Guidance = Annotated[float, Field(ge=0, le=GUIDANCE_LIMIT)]
Priority = Annotated[int, Field(ge=-PRIORITY_LIMIT, le=PRIORITY_LIMIT)]
User = Annotated[str, Field(max_length=MAX_USER_CHARS)]
