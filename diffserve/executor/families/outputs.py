"""Decoded images as the server answers them: uint8 by one rounding rule, with an image that is not
finite reported (it would turn black) rather than answered."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diffserve.executor.results import NON_FINITE


class NonFiniteOutput(RuntimeError):
    """Images with NaN or infinite pixels (a model that overflows its dtype): ``rows``, their
    indices in the batch; ``pixels``, the whole batch converted (the other rows are good). The
    request each belongs to fails with ``code``; uint8 would have made them black."""

    code = NON_FINITE

    def __init__(self, rows: list[int], pixels: np.ndarray | None = None) -> None:
        super().__init__("the model produced an image with NaN or infinite pixels (in half "
                         "precision, usually a model that overflows its dtype: try --dtype "
                         "bfloat16 or float32)")
        self.rows, self.pixels = rows, pixels


@dataclass
class Sounded:
    """Videos with their sound tracks, as a family that makes sound decodes them: ``pixels``
    (k, frames, H, W, 3) uint8, ``audio`` (k, channels, samples) float32 in [-1, 1] at
    ``sample_rate`` (None: the sound was not decoded)."""

    pixels: np.ndarray
    audio: np.ndarray | None
    sample_rate: int


def to_uint8(pixels) -> np.ndarray:
    """Float pixels in [0, 1] (k, H, W, 3, or k frames of them) to contiguous uint8, the one
    rounding rule everywhere. Raises :class:`NonFiniteOutput` where an image has a pixel that
    is not finite, checked once per image (NaN would round to 0: a black image). A torch tensor
    is converted where it is (on its device), in float32 as the host would."""
    if hasattr(pixels, "permute"):
        return _tensor_to_uint8(pixels)
    pixels = np.asarray(pixels)
    finite = np.isfinite(pixels.reshape(len(pixels), -1)).all(axis=1) if pixels.ndim else True
    with np.errstate(invalid="ignore"):  # a non-finite image is reported, not cast quietly
        converted = np.ascontiguousarray((np.clip(pixels, 0.0, 1.0) * 255.0).round()
                                         .astype(np.uint8))
    if not np.all(finite):
        raise NonFiniteOutput([int(i) for i in np.flatnonzero(~finite)], converted)
    return converted


def split_finite(decode, sizes: list[int]) -> list:
    """``decode()``'s uint8 rows cut into members of ``sizes`` rows; a member with a non-finite
    row gets a :class:`NonFiniteOutput` instead of its pixels (the others keep theirs)."""
    from diffserve.wire.samples import chunks

    try:
        return chunks(decode(), sizes)
    except NonFiniteOutput as bad:
        parts, start = [], 0
        for size, part in zip(sizes, chunks(bad.pixels, sizes)):
            rows = [r - start for r in bad.rows if start <= r < start + size]
            parts.append(NonFiniteOutput(rows) if rows else part)
            start += size
        return parts


def _tensor_to_uint8(pixels) -> np.ndarray:
    import torch

    pixels = pixels.float()  # the host's rule: float32, clip, scale, round half to even
    finite = torch.isfinite(pixels.reshape(len(pixels), -1)).all(dim=1)
    converted = (pixels.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).contiguous().cpu().numpy()
    finite = finite.cpu().numpy()
    if not np.all(finite):
        raise NonFiniteOutput([int(i) for i in np.flatnonzero(~finite)], converted)
    return converted
