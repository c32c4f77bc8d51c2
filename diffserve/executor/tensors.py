"""Tensors inside values, each question answered once: which tensors a value holds
(:func:`tensors_in`), how many bytes they take (:func:`nbytes`; torchao's quantized tensors by
what they store), and the value with every tensor on another device (:func:`moved`: what the step
engine parks on the host and brings back, and what crosses between a placed component's device
and the executor's)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator


def tensors_in(value, objects: bool = False) -> Iterator[Any]:
    """Every tensor in ``value``: itself, or inside dataclasses, lists, tuples and dicts (and,
    with ``objects``, inside any object's attributes); each once."""
    import torch

    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            stack.extend(getattr(v, f.name) for f in dataclasses.fields(v))
        elif objects and hasattr(v, "__dict__") and not isinstance(v, type):
            stack.extend(vars(v).values())


def stored_bytes(tensor) -> int:
    """What ``tensor`` takes: a torchao tensor keeps its dtype's name but stores int8 or float8
    data and scales; a tensor-parallel shard counts this rank's part."""
    local = getattr(tensor, "to_local", None)
    if local is not None:
        return stored_bytes(local())
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None or type(tensor).__name__ in ("Parameter", "Tensor"):
        return tensor.numel() * tensor.element_size()
    names, _ = flatten()
    return sum(stored_bytes(getattr(tensor, name)) for name in names)


def nbytes(value) -> int:
    """Bytes of every tensor in ``value`` (:func:`tensors_in`), as stored."""
    return sum(stored_bytes(t) for t in tensors_in(value))


def module_bytes(module) -> tuple[int, int]:
    """(bytes its parameters and buffers would take in their logical dtype, bytes they take):
    the two differ where weights are quantized."""
    tensors = [*module.parameters(), *module.buffers()]
    return (sum(t.numel() * t.element_size() for t in tensors),
            sum(stored_bytes(t) for t in tensors))


def moved(value, device):
    """``value`` with every tensor in it on ``device``: tensors, dataclasses (a Conditioning, a
    Prepared, a model's output), lists, tuples and dicts, and diffusers' Gaussian distributions
    (a VAE's ``encode``). A named tuple, and anything else, is left as it is."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: moved(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(moved(v, device) for v in value)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    if type(value).__name__ == "DiagonalGaussianDistribution":
        return type(value)(value.parameters.to(device), value.deterministic)
    return value
