"""Decoded pixels to uint8 on the device: the same bytes as the host's conversion of the same
float32 values (one rounding rule), and an image with a pixel that is not finite reported by row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffserve.executor.families.outputs import NonFiniteOutput, to_uint8


def test_the_device_conversion_equals_the_hosts():
    gen = torch.Generator().manual_seed(0)
    pixels = torch.rand(3, 16, 16, 3, generator=gen) * 1.2 - 0.1  # out of range too
    pixels[0, 0, :4, 0] = torch.tensor([0.5 / 255, 1.5 / 255, 2.5 / 255, 254.5 / 255])  # ties
    for dtype in (torch.float32, torch.bfloat16):
        values = pixels.to(dtype)
        host = to_uint8(values.float().numpy())
        assert np.array_equal(to_uint8(values), host)
        assert host.flags.c_contiguous and host.dtype == np.uint8


def test_a_non_finite_image_is_reported_by_row():
    pixels = torch.rand(3, 4, 4, 3)
    pixels[1, 2, 2, 1] = float("nan")
    with pytest.raises(NonFiniteOutput) as raised:
        to_uint8(pixels)
    assert raised.value.rows == [1]
    assert np.array_equal(raised.value.pixels[[0, 2]], to_uint8(pixels[[0, 2]]))
