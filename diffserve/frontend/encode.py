"""Raw pixels to base64 PNG/JPEG/WebP: small responses on the event loop, large ones in a
thread pool so that encoding never holds up other requests for long."""

from __future__ import annotations

import asyncio
import base64
import io
from concurrent.futures import Executor

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


# Up to this many pixels per response, encoding (at most about 3 ms, a 128x128 PNG of a busy
# image) runs on the event loop: a hop to a pool thread and back costs about 0.5 ms, which at
# these sizes is a large part of the whole. Larger responses go to the pool and encode in parallel.
INLINE_ENCODE_MAX_PIXELS = 128 * 128


async def encode_images(pool: Executor, frames: list, width: int, height: int,
                        output_format: str, compression: int | None = None) -> list[str]:
    """Encode a response's images: small ones inline, large ones in ``pool`` (in parallel)."""
    buffers = [frame.buffer if hasattr(frame, "buffer") else frame for frame in frames]
    if len(buffers) * width * height <= INLINE_ENCODE_MAX_PIXELS:
        return [encode_image(b, width, height, output_format, compression) for b in buffers]
    loop = asyncio.get_running_loop()
    return list(await asyncio.gather(*(
        loop.run_in_executor(pool, encode_image, b, width, height, output_format, compression)
        for b in buffers)))
