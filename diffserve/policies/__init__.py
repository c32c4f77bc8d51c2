"""Scheduling policies, each one file, named by configuration.

Two decisions are policies, and nothing else decides them:

- **queue order** (``--scheduling-policy``): which waiting request is the head, the one the next
  batch or admission is built around (:class:`~diffserve.policies.base.QueuePolicy`);
- **set choice** (``--set-policy``, step mode): which running set the next denoising step
  advances when an executor holds several (:class:`~diffserve.policies.base.SetPolicy`).

A new policy is a file here plus one line in the registry below. Torch-free: the scheduler and
the executors both read it.
"""

from __future__ import annotations

from diffserve.policies.base import Member, QueuePolicy, SetPolicy
from diffserve.policies.fair import TimeFair
from diffserve.policies.fcfs import FirstCome
from diffserve.policies.oldest import OldestFirst
from diffserve.policies.priority import PriorityOrder
from diffserve.policies.sjf import ShortestJobFirst
from diffserve.policies.srpt import SoonestFirst

QUEUE_POLICIES: dict[str, type[QueuePolicy]] = {
    FirstCome.name: FirstCome,
    ShortestJobFirst.name: ShortestJobFirst,
    PriorityOrder.name: PriorityOrder,
}
SET_POLICIES: dict[str, type[SetPolicy]] = {
    TimeFair.name: TimeFair,
    SoonestFirst.name: SoonestFirst,
    OldestFirst.name: OldestFirst,
}

__all__ = ["Member", "QueuePolicy", "SetPolicy", "QUEUE_POLICIES", "SET_POLICIES",
           "queue_policy", "queue_policy_for", "set_policy"]


def queue_policy(name: str, **options) -> QueuePolicy:
    return _make(QUEUE_POLICIES, name, "--scheduling-policy", options)


def queue_policy_for(config) -> QueuePolicy:
    """The queue policy ``config`` names, with its options from the configuration."""
    return _named(QUEUE_POLICIES, config.scheduling_policy, "--scheduling-policy").from_config(config)


def set_policy(name: str, **options) -> SetPolicy:
    return _make(SET_POLICIES, name, "--set-policy", options)


def _make(registry: dict, name: str, flag: str, options: dict):
    return _named(registry, name, flag)(**options)


def _named(registry: dict, name: str, flag: str):
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"{flag} {name!r} is not one of {', '.join(registry)}") from None
