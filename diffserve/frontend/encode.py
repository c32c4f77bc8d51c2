"""Raw pixels to base64 PNG/JPEG/WebP. Runs in a thread pool, off the event loop."""

from __future__ import annotations

import base64
import io

from PIL import Image

_DEFAULT_QUALITY = 90


def encode_image(buffer, width: int, height: int, output_format: str,
                 compression: int | None = None) -> str:
    """``buffer``: uint8 RGB pixels, row-major (height, width, 3). Returns base64 text."""
    image = Image.frombuffer("RGB", (width, height), buffer, "raw", "RGB", 0, 1)
    out = io.BytesIO()
    if output_format == "png":
        # PNG is lossless: the knob trades size for time (0-100 mapped onto zlib's 0-9).
        level = 6 if compression is None else round(compression * 9 / 100)
        image.save(out, format="PNG", compress_level=level)
    elif output_format == "jpeg":
        image.save(out, format="JPEG", quality=_DEFAULT_QUALITY if compression is None else compression)
    elif output_format == "webp":
        image.save(out, format="WEBP", quality=_DEFAULT_QUALITY if compression is None else compression)
    else:
        raise ValueError(f"unknown output format {output_format!r}")
    return base64.b64encode(out.getbuffer()).decode("ascii")
