"""Every tensor in a value moved to a device: what the step engine parks on the host and brings
back (a request's Conditioning and Prepared), and what crosses between a placed component's
device and the executor's (a text encoder's or VAE's inputs and outputs)."""

from __future__ import annotations

import dataclasses


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
