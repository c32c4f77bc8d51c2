"""The OpenAI images parameters that ask for what this server does not make (transparent
backgrounds, GIF or SVG output): each is accepted by the body, so a client sending the API's
whole set of values is not told the parameter is unknown, and refused here naming the value.
Parameters that have no effect here (``moderation``, ``style``, ``quality``, ``complexity``,
``input_fidelity``, ``user``) pass; docs/api.md says what each means on this server."""

from __future__ import annotations

from diffserve.errors import invalid_request
from diffserve.frontend.schemas import ImageOptions

SERVED_FORMATS = ("png", "jpeg", "webp")


def unserved(value: str, param: str, why: str):
    return invalid_request(f"{param}={value!r} is not served here: {why}", param,
                           "unsupported_value")


def check_served(body: ImageOptions) -> None:
    """A 400 naming the first value the server cannot honour."""
    if body.background == "transparent":
        raise unserved("transparent", "background", "images are always opaque (use 'auto' or "
                       "'opaque')")
    if body.output_format not in SERVED_FORMATS:
        raise unserved(body.output_format, "output_format",
                       f"the server encodes {', '.join(SERVED_FORMATS)}")
    for param in ("frame_count", "frame_duration_ms"):
        value = getattr(body, param)
        if value is not None:
            raise unserved(str(value), param, "it is for GIF output, which is not served")
    if body.svg is not None:
        raise unserved(str(body.svg), "svg", "it is for SVG output, which is not served")


def check_form_fields(fields: dict[str, str], files: dict[str, list[bytes]]) -> None:
    """An edit form's parts that select what is not served: a ``markup`` file (SVG output's
    annotations) and ``svg[...]`` fields (how the SDK sends the ``svg`` object in a form)."""
    if files.get("markup"):
        raise unserved("<file>", "markup", "it is for SVG output, which is not served")
    for name, value in fields.items():
        if name.startswith("svg["):
            raise unserved(value, "svg", "it is for SVG output, which is not served")
