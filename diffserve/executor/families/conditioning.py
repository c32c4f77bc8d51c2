"""What a family's requests carry into the step engine: a :class:`Conditioning` (the prompt's
encoding as the denoiser takes it, one row per image, each field declaring how its rows combine),
the :class:`Encoded` pair of positive and negative conditioning, and a request's :class:`Prepared`
starting point (with an inpainting :class:`Blend`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# How a Conditioning field combines across the rows of a forward (its field metadata):
BATCHED = "batched"  # one row per image; rows are concatenated (the default)
SHARED = "shared"    # the same value for every row (e.g. text position ids); taken once
PADDED = "padded"    # rows of different lengths (dim 1): padded with zeros to the longest
HOST = "host"        # one value per row kept on the host (a tuple), read without the device


def shared(default: Any = None) -> Any:
    return field(default=default, metadata={"rows": SHARED})


def on_host(default: Any = ()) -> Any:
    """A per-row value the forward reads on the host (a caption's length): a tuple, one entry
    per row, so that reading it never waits for the device."""
    return field(default=default, metadata={"rows": HOST})


def padded(default: Any = dataclasses.MISSING, rounded: bool = True) -> Any:
    """A field whose rows may differ in length (text tokens): padded with zeros when rows of
    different requests are stacked; a mask field declared the same way gets zeros too, so the
    padding is masked out. ``rounded``: to the stack's multiple (text lengths, for static
    shapes), else to the longest alone (an edit's reference tokens, whose rows of several sizes
    the family lays out itself)."""
    return field(default=default, metadata={"rows": PADDED, "rounded": rounded})


@dataclass
class Conditioning:
    """A request's conditioning as its family's denoiser takes it: batch-first tensors. A family
    declares its own subclass; the engine only repeats, concatenates and slices rows, and the
    family decides how (override :meth:`cat` where rows need padding)."""

    def _fields(self, *kinds: str) -> list[str]:
        """The fields combined as one of ``kinds`` that are set (a family may fill some in
        later)."""
        return [f.name for f in dataclasses.fields(self)
                if f.metadata.get("rows", BATCHED) in kinds and getattr(self, f.name) is not None]

    def repeat(self, count: int) -> "Conditioning":
        """Each row repeated ``count`` times in place (a request's prompt for each of its images)."""
        return dataclasses.replace(
            self, **{name: getattr(self, name).repeat_interleave(count, dim=0)
                     for name in self._fields(BATCHED, PADDED)},
            **{name: tuple(v for v in getattr(self, name) for _ in range(count))
               for name in self._fields(HOST)})

    def rows(self, start: int, stop: int) -> "Conditioning":
        return self.select(slice(start, stop))

    def select(self, index, rows: list[int] | None = None) -> "Conditioning":
        """The rows at ``index`` (a slice, or a tensor of row numbers; ``rows``: the same on the
        host, where the caller has them, so the device's are not read back)."""
        host = index if isinstance(index, slice) else rows if rows is not None else index.tolist()
        return dataclasses.replace(
            self, **{name: getattr(self, name)[index] for name in self._fields(BATCHED, PADDED)},
            **{name: _pick(getattr(self, name), host) for name in self._fields(HOST)})

    @classmethod
    def cat(cls, parts: list["Conditioning"], multiple: int = 1) -> "Conditioning":
        """``parts`` stacked; padded fields to the longest, rounded up to ``multiple``."""
        import torch

        first = parts[0]
        joined = {name: torch.cat([getattr(p, name) for p in parts])
                  for name in first._fields(BATCHED)}
        joined.update({name: sum((tuple(getattr(p, name)) for p in parts), ())
                       for name in first._fields(HOST)})
        rounded = {f.name: f.metadata.get("rounded", True) for f in dataclasses.fields(first)}
        for name in first._fields(PADDED):
            tensors = [getattr(p, name) for p in parts]
            step = multiple if rounded[name] else 1
            longest = -(-max(t.shape[1] for t in tensors) // step) * step
            joined[name] = torch.cat([torch.nn.functional.pad(
                t, (0, 0) * (t.dim() - 2) + (0, longest - t.shape[1])) for t in tensors])
        return dataclasses.replace(first, **joined)

    @property
    def dtype(self):
        return getattr(self, self._fields(BATCHED, PADDED)[0]).dtype

    def prompt_tensors(self) -> dict[str, Any]:
        """A one-row conditioning's prompt encoding as a rollout returns it, by name
        (:mod:`diffserve.wire.rollouts`): ``prompt_embeds`` [L, D] without padding, and
        ``pooled_prompt_embeds`` [D] where the family has them."""
        raise NotImplementedError(f"{type(self).__name__} does not return its prompt encoding")


def _pick(values: tuple, index) -> tuple:
    return values[index] if isinstance(index, slice) else tuple(values[i] for i in index)


@dataclass
class Encoded:
    """Text conditioning of several prompts, one row each; ``negative`` with classifier-free
    guidance."""

    positive: Conditioning
    negative: Conditioning | None = None


@dataclass
class Blend:
    """Inpainting: outside ``mask`` every step puts back the input's latents at the noise level
    of the next timestep."""

    mask: Any
    image_latents: Any
    noise: Any


@dataclass
class Prepared:
    """A request's starting point: its schedule, its first latents, and what conditions it (the
    prompt's, plus anything the family adds per request, such as SDXL's size ids)."""

    timesteps: Any
    latents: Any
    positive: Conditioning
    negative: Conditioning | None
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    blend: Blend | None = None
    # Its ControlNet controls, each with its condition (the control image as its model takes it,
    # one row per image): (diffserve.wire.request.Control, tensor) pairs.
    controls: list = field(default_factory=list)
