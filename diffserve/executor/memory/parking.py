"""A paused request's tensors off the accelerator and back: its latents and conditioning, its own
noise scheduler's state and its step cache. The one place a request's state changes device; the
step engine parks a request when the scheduler pauses it for a better priority class, so that
its memory goes to the others."""

from __future__ import annotations

from diffserve.executor.tensors import moved


def park(unit) -> None:
    """``unit``'s state (a :class:`~diffserve.executor.step.units.Unit`) to the host."""
    unit.prepared = moved(unit.prepared, "cpu")
    unit.parked = park_state(unit.scheduler)
    if unit.cache is not None:
        unit.cache.to("cpu")


def unpark(unit, device) -> None:
    """Back from :func:`park`: the latents and conditioning to ``device``, each of the
    scheduler's tensors where it was before."""
    unit.prepared = moved(unit.prepared, device)
    restore_state(unit.scheduler, unit.parked)
    unit.parked = {}
    if unit.cache is not None:
        unit.cache.to(device)


def park_state(scheduler) -> dict[str, object]:
    """A scheduler's tensors (and lists of them) moved to the host in place; returns where each
    attribute that held tensors was, for :func:`restore_state` (a scheduler keeps some on the
    host on purpose, flow-matching sigmas among them: reading those never waits for the device)."""
    import torch

    places = {}
    for name, value in vars(scheduler).items():
        if name == "config":
            continue
        tensors = [v for v in (value if isinstance(value, (list, tuple)) else [value])
                   if isinstance(v, torch.Tensor)]
        if tensors:
            places[name] = tensors[0].device
            setattr(scheduler, name, moved(value, "cpu"))
    return places


def restore_state(scheduler, places: dict[str, object]) -> None:
    """Each parked attribute back where it was."""
    for name, device in places.items():
        setattr(scheduler, name, moved(getattr(scheduler, name), device))
