"""Server-Sent Events for streamed image requests, shaped as OpenAI's: ``<prefix>.partial_image``
events while the images are made, one ``<prefix>.completed`` event per image, and an ``error``
event if the request fails after the stream has started.

With ``n > 1`` every image streams its own previews and its own completed event; the events of
different images interleave as the engine makes them, and each carries ``image_index`` (an
extension field) so a client can tell them apart.
"""

from __future__ import annotations

from typing import Any

import orjson

# The event name prefix of each endpoint's stream.
GENERATIONS, EDITS = "image_generation", "image_edit"


def event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def partial_image(prefix: str, common: dict[str, Any], b64: str, partial_index: int,
                  image_index: int, n: int) -> bytes:
    data = {"type": f"{prefix}.partial_image", "b64_json": b64, **common,
            "partial_image_index": partial_index}
    if n > 1:
        data["image_index"] = image_index
    return event(data["type"], data)


def completed(prefix: str, common: dict[str, Any], b64: str, usage: dict[str, Any],
              image_index: int, n: int, seed: int) -> bytes:
    data = {"type": f"{prefix}.completed", "b64_json": b64, **common, "usage": usage,
            "seed": seed}
    if n > 1:
        data["image_index"] = image_index
    return event(data["type"], data)


def error(body: dict[str, Any]) -> bytes:
    """``body``: the OpenAI error body, ``{"error": {...}}``; the SDK raises it as an APIError."""
    return event("error", {"type": "error", **body})
