"""The plan of one denoising step: who leaves, who is paused, who joins, and which running set
advances.

The step engine (:mod:`diffserve.executor.step.engine`) plans a step here, then executes it
(admissions, the forward, every request's scheduler step, decodes). Planning reads only the
requests' bookkeeping and the time: no torch, so its rules are tested with a fake clock, and the
set choice is a policy named by configuration (:mod:`diffserve.policies`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

from diffserve.policies import SetPolicy
from diffserve.policies.base import Member


@dataclass(frozen=True)
class Planned:
    """A request the plan is about: its id, its running set, and its bookkeeping; for one
    waiting inside the engine, whether it could be admitted now (its adapters fit)."""

    request_id: str
    batch_key: Hashable
    member: Member
    ready: bool = True
    start: int = 0  # its first image: with the request id, the work item it is

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.start)


@dataclass
class StepPlan:
    leave: list[str] = field(default_factory=list)  # request ids cancelled: they leave now
    pause: list[tuple[str, int]] = field(default_factory=list)  # items paused (kept) now
    join: list[str] = field(default_factory=list)  # waiting (deferred) requests admitted now
    advance: Hashable | None = None  # the batch key of the set this step advances


class Planner:
    def __init__(self, policy: SetPolicy) -> None:
        self.policy = policy

    def plan(self, running: Sequence[Planned], waiting: Sequence[Planned], cancelled: set[str],
             now: float, pausing: set = frozenset()) -> StepPlan:
        """``running``: the requests in running sets; ``waiting``: the ones handed to the engine
        that wait inside it for adapter slots (the last step's retirements may have freed some);
        ``cancelled``: ids whose callers have gone; ``pausing``: items the scheduler paused to
        make room for better priority classes. The set to advance is chosen among the running
        requests that stay and those that join now."""
        plan = StepPlan(leave=[e.request_id for e in (*running, *waiting)
                               if e.request_id in cancelled])
        gone = set(plan.leave)
        staying = [e for e in running if e.request_id not in gone]
        plan.pause = [e.key for e in staying if e.key in pausing]
        joining = [e for e in waiting if e.ready and e.request_id not in gone]
        plan.join = [e.request_id for e in joining]
        plan.advance = self.choose([e for e in staying if e.key not in pausing] + joining, now)
        return plan

    def choose(self, entries: Sequence[Planned], now: float) -> Hashable | None:
        """The batch key of the set to advance among ``entries`` (None if there are none)."""
        sets: dict[Hashable, list[Member]] = {}
        for e in entries:
            sets.setdefault(e.batch_key, []).append(e.member)
        return self.policy.choose(sets, now) if sets else None
