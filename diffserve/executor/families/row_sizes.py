"""Rows of different sizes in one transformer forward.

A transformer denoiser sees an image as a sequence of tokens, so images of different sizes are
sequences of different lengths. One forward carries them padded: every row's image tokens are
padded with zeros to the longest row's, a key mask keeps each row's attention off the padding
(no real token ever attends to one), each row gets its own rotary positions, and each row's
prediction is its own leading tokens. Modulation is per row already (its timestep and
guidance), and every other layer acts per token. A row so computed equals the row run alone, up
to float summation order.

Padded rather than packed: a packed (variable-length) forward needs the flash kernels' varlen
entry points, which the CPU and the default attention backends lack, and a block-diagonal mask
over one long sequence costs the square of the whole forward's tokens. The padding's cost is
priced into admission (docs/batching.md, "Sizes in one forward").

The transformers' own attention processors apply one set of positions to every row; a mixed
forward swaps them, for its duration only, for the family's per-row processor
(:func:`processors_swapped`), so that a forward of one size runs the model exactly as before.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence


@dataclass(frozen=True)
class RowSizes:
    """The rows of one forward: each row's (width, height) and image tokens, and the tokens
    each is padded to (``length``: the longest row's of the whole set, also where a forward
    takes some of its rows)."""

    sizes: tuple[tuple[int, int], ...]
    tokens: tuple[int, ...]
    length: int = 0
    shapes: tuple[tuple[int, ...], ...] = ()  # each row's latents' shape past the rows

    def __post_init__(self) -> None:
        if not self.length:
            object.__setattr__(self, "length", max(self.tokens))

    def valid(self, torch, device):
        """(rows, length) bool: True at each row's own tokens."""
        at = torch.arange(self.length, device=device)
        return at[None, :] < torch.tensor(self.tokens, device=device)[:, None]

    def select(self, rows: Sequence[int]) -> "RowSizes":
        return RowSizes(tuple(self.sizes[r] for r in rows), tuple(self.tokens[r] for r in rows),
                        self.length, tuple(self.shapes[r] for r in rows) if self.shapes else ())

    def distinct(self) -> list[tuple[int, int]]:
        """The sizes in first-seen order."""
        return list(dict.fromkeys(self.sizes))


def padded_rows(torch, parts: Sequence[Any]):
    """``parts`` (rows_i, ...) stacked, each padded with zeros at the end of every dimension
    past the first to the largest part's: packed tokens (rows, tokens, channels) to the most
    tokens, latents a family's transformer patchifies itself (rows, channels, h, w) to the
    tallest and the widest."""
    shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    padded = []
    for p in parts:
        if list(p.shape[1:]) != shape:
            grown = p.new_zeros((p.shape[0], *shape))
            grown[(slice(None), *(slice(0, side) for side in p.shape[1:]))] = p
            p = grown
        padded.append(p)
    return torch.cat(padded)


def own_part(padded, like):
    """A part of :func:`padded_rows`' output cut back to the shape of ``like`` (past rows)."""
    return padded[(slice(None), *(slice(0, side) for side in like.shape[1:]))]


def by_row(torch, per_size: dict[tuple[int, int], Any], rows: RowSizes, length: int, fill):
    """Each row's tensor of its size (``per_size``: size -> (tokens, ...)), padded with
    ``fill(shape, like)`` to ``length`` along dim 0 and stacked: (rows, length, ...)."""
    padded = {}
    for size, t in per_size.items():
        padded[size] = t if t.shape[0] == length else torch.cat(
            [t, fill((length - t.shape[0], *t.shape[1:]), t)])
    return torch.stack([padded[size] for size in rows.sizes])


def joined_rows(parts: Sequence[tuple[Any, Sequence[int]]], length: int):
    """Each row's own tokens of every part, one part after another, padded with zeros to
    ``length``: ``parts`` are (tensor (rows, tokens, C), each row's own token count), as an
    edit's rows carry their image's tokens, then their reference's."""
    first = parts[0][0]
    out = first.new_zeros((first.shape[0], length, first.shape[-1]))
    for row in range(first.shape[0]):
        at = 0
        for tensor, counts in parts:
            out[row, at:at + counts[row]] = tensor[row, :counts[row]]
            at += counts[row]
    return out


# Each model's modules that have an attention processor, found once (a walk over a real-size
# transformer's thousand modules at every forward would cost a millisecond of host time).
_attention: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def attention_modules(model) -> list:
    if model not in _attention:
        _attention[model] = [m for m in model.modules() if hasattr(m, "processor")]
    return _attention[model]


@contextmanager
def processors_swapped(model, kinds: tuple[type, ...],
                       make: Callable[[Any], Callable]) -> Iterator[None]:
    """For the duration, every attention module of ``model`` whose processor is one of
    ``kinds`` runs ``make(processor)`` instead."""
    modules = [m for m in attention_modules(model) if isinstance(m.processor, kinds)]
    saved = [m.processor for m in modules]
    try:
        for m, processor in zip(modules, saved):
            m.processor = make(processor)
        yield
    finally:
        for m, processor in zip(modules, saved):
            m.processor = processor


def foreign_processors(model, kinds: tuple[type, ...]) -> list[str]:
    """The processors of ``model``'s attention modules that are not one of ``kinds`` (an
    IP-Adapter's, a user's): a mixed forward cannot swap those."""
    return sorted({type(m.processor).__name__ for m in model.modules()
                   if getattr(m, "processor", None) is not None
                   and not isinstance(m.processor, kinds)})


# The dispatcher's kernels that take a mask: a mixed forward's attention always has one, so a
# backend chosen for unmasked forwards (a flash kernel) gives way to native there.
MASKED_BACKENDS = frozenset({"native", "_native_math", "_native_efficient"})


def masked_backend(inner):
    """The attention backend a mixed forward runs where ``inner`` (the model's processor) runs
    its own: the same where it takes a mask, else native (torch's SDPA picks a kernel that
    takes one)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    backend = getattr(inner, "_attention_backend", None)
    if backend is not None and str(getattr(backend, "value", backend)) in MASKED_BACKENDS:
        return backend
    return AttentionBackendName.NATIVE


def rotate_pairs(x, cos, sin):
    """Rotary positions on ``x`` (rows, tokens, heads, dim), adjacent channel pairs rotated
    (Flux's layout), with each row's own ``cos`` and ``sin`` (rows, tokens, dim)."""
    import torch

    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    turned = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos[:, :, None, :] + turned.float() * sin[:, :, None, :]).to(x.dtype)


def rotate_complex(x, freqs):
    """Rotary positions on ``x`` (rows, tokens, heads, dim) as complex products, with each
    row's own ``freqs`` (rows, tokens, dim / 2, complex) (Qwen-Image's layout)."""
    import torch

    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs[:, :, None, :]).flatten(3).type_as(x)
