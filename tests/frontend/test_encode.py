"""Image encoding: every format round-trips, and small and large responses (encoded on the event
loop and in the pool respectively) give the same pixels."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from diffserve.frontend.encode import INLINE_ENCODE_MAX_PIXELS, encode_image, encode_images


def _pixels(count: int, side: int) -> list[np.ndarray]:
    rng = np.random.default_rng(side)
    return [rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(count)]


def _decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_formats_round_trip(fmt):
    (pixels,) = _pixels(1, 32)
    image = Image.open(io.BytesIO(base64.b64decode(encode_image(pixels, 32, 32, fmt))))
    assert image.format == {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt]
    assert image.size == (32, 32)
    if fmt == "png":  # lossless
        assert np.array_equal(np.asarray(image.convert("RGB")), pixels)


class _CountingPool(ThreadPoolExecutor):
    def __init__(self):
        super().__init__(max_workers=2)
        self.submitted = 0
        self._lock = threading.Lock()

    def submit(self, *args, **kwargs):
        with self._lock:
            self.submitted += 1
        return super().submit(*args, **kwargs)


@pytest.mark.parametrize("count, side", [(1, 32), (4, 64), (2, 128), (1, 256)])
def test_small_responses_inline_large_ones_in_the_pool(count, side):
    frames = _pixels(count, side)
    with _CountingPool() as pool:
        encoded = asyncio.run(encode_images(pool, frames, side, side, "png"))
    inline = count * side * side <= INLINE_ENCODE_MAX_PIXELS
    assert pool.submitted == (0 if inline else count)
    assert [np.array_equal(_decode(b64), f) for b64, f in zip(encoded, frames)] == [True] * count
