"""The start-up checks on a built runtime: run them (or recall their verdict from an earlier start
of the same model and code), then serve what they allow: a task whose plain pipeline fails is not
offered, a task the step engine gets wrong runs in request mode, and only the samplers that work
are offered."""

from __future__ import annotations

import dataclasses
import logging

from diffserve.config.flags import ServerConfig
from diffserve.executor.checks import float32, startup, verdicts
from diffserve.executor.families.known import UnsupportedMode
from diffserve.executor.memory.budget import budget_of
from diffserve.wire.protocol import REQUEST_MODE, STEP_MODE
from diffserve.wire.tasks import GENERATE, TASKS
from diffserve.wire.request import WITH_CONTROLS

log = logging.getLogger(__name__)


def check(rt, config: ServerConfig) -> None:
    """The start-up checks (:mod:`~diffserve.executor.checks.startup`), or their verdict from an
    earlier start of the same model and code (:mod:`~diffserve.executor.checks.verdicts`)."""
    key = verdicts.key_of(rt, config)
    verdict = verdicts.recall(key)
    if rt.group is not None:  # every rank runs the checks' forwards together, or none does
        verdict = rt.group.broadcast(verdict)
    # Where a half-precision model's float32 reference runs: asked once, for both checks.
    where = (float32.DEVICE if rt.loaded.dtype == "float32" or verdict is not None
             else float32.place(rt, budget_of(config, rt.loaded.device)))
    if verdict is not None:
        log.info("start-up checks: the verdict of an earlier start of this model and code")
    else:
        found = startup.check(rt, where)
        verdict = {"unavailable": found.unavailable, "fallback": found.fallback}
    apply_verdicts(rt, config, verdict["unavailable"], verdict["fallback"])
    if rt.info.schedulers:
        if "samplers" not in verdict:
            task = startup.checked_tasks(rt)[0]
            verdict["samplers"] = startup.samplers(rt, rt.info.schedulers, task,
                                                   rt.task_modes[task] == STEP_MODE, where)
        working, failing = verdict["samplers"]
        for name, reason in failing.items():
            log.info("sampler %s is not offered: %s", name, reason)
        rt.info = dataclasses.replace(rt.info, schedulers=list(working))
    if where == float32.SKIP:  # judged without the float32 reference: a roomier host judges it
        log.warning("start-up check: no float32 reference fitted; this verdict is not remembered")
        return
    verdicts.remember(key, verdict)


def apply_verdicts(rt, config: ServerConfig, unavailable: dict[str, str],
                   fallback: dict[str, str]) -> None:
    """Serve what the checks allow: a task whose plain pipeline fails is not offered; a task the
    step engine gets wrong runs in request mode, the others keep step mode. Rollouts sample on
    the step engine's generation, so they go where generation cannot run in it. A task with
    controls (its mode key ``TASK+controls``) is decided on its own, and decides nothing of the
    task without them. Raises where nothing can be served, or where --batching-mode step finds
    no task for the step engine."""
    unavailable, fallback = dict(unavailable), dict(fallback)
    if rt.group is not None:  # a group runs the step engine only
        unavailable.update({task: f"{why}, and request mode does not run in a parallel group"
                            for task, why in fallback.items()})
        fallback = {}
    for task in [t for t in rt.pipelines if TASKS[t].trajectory]:
        for suffix in ("", WITH_CONTROLS):
            key = GENERATE.name + suffix
            why = unavailable.get(key) or fallback.get(key)
            if why is not None:
                unavailable[task + suffix] = (f"rollouts sample on the step engine's generation, "
                                              f"and {why}")
    checked = [t for t in rt.pipelines if not TASKS[t].trajectory]
    if checked and all(t in unavailable for t in checked):
        raise RuntimeError("no task of this model can be served: " + _reasons(unavailable))
    for key, why in unavailable.items():
        log.warning("task %s is not served: %s", key, why)
        rt.pipelines.pop(key, None)  # a task; a task with controls keeps its task served
    rt.unavailable = unavailable
    rt.fallback = {key: why for key, why in fallback.items()
                   if key.split("+")[0] in rt.pipelines}
    if rt.mode == STEP_MODE and all(t in rt.fallback for t in checked if t in rt.pipelines):
        # (controls alone in the step engine would be a server whose plain requests all run in
        # request mode: the checks' verdict on tasks decides the executor's mode)
        if config.batching_mode == STEP_MODE:
            raise UnsupportedMode("--batching-mode step: on this model the step engine can serve "
                                  f"no task ({_reasons({**rt.fallback, **unavailable})}); use "
                                  "--batching-mode request (or auto)")
        rt.mode = REQUEST_MODE
        if rt.step_cache is not None:
            log.warning("--step-cache runs in step mode only: serving without it")
            rt.step_cache.close()
            rt.step_cache = None
    for task, why in rt.fallback.items():
        log.warning("serving %s in request mode: the start-up check found that on this model "
                    "the step engine does not match the plain pipeline (%s)", task, why)
    rt.info = rt.describe()


def _reasons(why: dict[str, str]) -> str:
    return "; ".join(f"{task}: {reason}" for task, reason in why.items())
