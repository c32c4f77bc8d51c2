"""A model ready to serve, built in one place: load the pipeline, pick the family and the
batching mode, build each task's pipeline, load the LoRA adapters, and describe it all for the
frontend. The executor process, ``diffserve calibrate`` and the offline benchmark all start here,
so what they measure is what the server runs."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

from diffserve.config import ServerConfig
from diffserve.executor import check_verdicts, memory_budget, self_check
from diffserve.executor.accelerators import compiled_for, step_cache_for, warm_up
from diffserve.executor.loading import (
    LoadedModel,
    UnsupportedMode,
    load_model,
    model_info,
    resolve_mode,
    task_pipelines,
    token_counter,
)
from diffserve.executor.memory_layout import MemoryLayout
from diffserve.models.registry import resolve_model
from diffserve.protocol import REQUEST_MODE, STEP_MODE, ModelInfo
from diffserve.tasks import TASKS

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    loaded: LoadedModel
    family: Any  # the step engine's family (an instance), None where it does not know the pipeline
    pipelines: dict[str, Any]  # task name -> its pipeline, for every task served
    mode: str  # the executor's mode: step where any task runs in the step engine
    info: ModelInfo
    adapters: Any  # the AdapterStore, None where the server serves no adapters
    count_tokens: Callable[[str], int]
    config: ServerConfig
    step_cache: Any = None  # over the family's denoisers, where --step-cache runs
    compiled: Any = None  # the denoisers' compiled blocks, where --compile runs
    # What the start-up checks decided, per task (diffserve.executor.self_check): the tasks
    # served in request mode although the executor runs the step engine, and the tasks not
    # served at all; each with why.
    fallback: dict[str, str] = dataclasses.field(default_factory=dict)
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)
    group: Any = None  # the parallel group this process is a rank of (diffserve.executor.parallel)
    prompt_cache: Any = None  # diffserve.executor.prompt_cache.PromptCache, where one is kept
    weights: Any = None  # diffserve.executor.weights.Weights, with --enable-weight-updates

    @property
    def task_modes(self) -> dict[str, str]:
        """The batching mode of each task served."""
        return {task: REQUEST_MODE if self.mode == REQUEST_MODE or task in self.fallback
                else STEP_MODE for task in self.pipelines}

    def describe(self) -> ModelInfo:
        """The model info of what is served now."""
        return model_info(self.loaded, self.config, self.mode, type(self.family) if self.family
                          else None, list(self.pipelines),
                          list(self.adapters.current) if self.adapters else [],
                          self.task_modes, self.unavailable, self.group)

    @property
    def threaded_stages(self) -> bool:
        """Whether the served step engine encodes and decodes beside its loop (--stages)."""
        if self.config.stages != "auto":
            return self.config.stages == "on"
        # A CPU stage thread takes cores and the interpreter lock from the loop's forwards: it
        # shortens the longest pause only where the loop leaves it a core (docs/batching.md).
        return self.group is None and self.family.torch.device(self.family.device).type == "cuda"

    def step_engine(self, **kwargs):
        """A step engine over this model, with the configured set policy and prompt cache; its
        stages inline unless ``stages=True`` (the executor's loop asks for the configured ones)."""
        from diffserve.executor.step_engine import StepEngine
        from diffserve.policies import set_policy

        kwargs.setdefault("policy", set_policy(self.config.set_policy_name))
        kwargs.setdefault("prompt_cache", self.prompt_cache)
        return StepEngine(self.family, self.count_tokens, adapters=self.adapters,
                          step_cache=self.step_cache, cache_threshold=self.config.cache_threshold,
                          group=self.group, **kwargs)

    def request_runner(self, should_interrupt=lambda: False, emit_partial=lambda partial: None,
                       emit_progress=lambda *progress: None):
        from diffserve.executor.request_runner import RequestRunner

        return RequestRunner(self.loaded, self.pipelines, self.family, self.count_tokens,
                             should_interrupt, emit_partial, self.adapters, emit_progress)


def build_runtime(config: ServerConfig, device: str | None = None, torch_threads: int = 0,
                  index: int = 0, on_adapter_event=lambda event, **kw: None,
                  group=None) -> Runtime:
    """The model of ``config`` on ``device`` (default ``config.device``), ready to serve;
    ``group``: the parallel group this process is a rank of (every rank builds the same).
    Raises where it cannot serve as configured (an unknown family with --batching-mode step,
    an adapter that does not load, no task that can be served, a group the model cannot run)."""
    from diffserve.executor import parallel
    from diffserve.executor.families import family_for

    tensor_parallel = group is not None and group.degrees.tp > 1
    loaded = load_model(config.model, device or config.device, config.dtype, torch_threads, index,
                        config.quantization,
                        (lambda path, dtype: parallel.tensor_parallel_denoisers(path, group, dtype))
                        if tensor_parallel else None, MemoryLayout.of(config),
                        config.text_encoder_quantization)
    family_cls = family_for(loaded.pipeline_class)
    mode = resolve_mode(config.batching_mode, family_cls, loaded.pipeline_class)
    pipelines = task_pipelines(loaded.pipe, family_cls)
    family = family_cls(loaded.pipe, pipelines, loaded.call_kwargs) if family_cls else None
    if group is not None:
        parallel.parallelize(loaded.pipe, family, group)
    adapters = load_adapters(loaded.pipe, config, on_adapter_event)
    compiled = compiled_for(config, loaded, family)  # before the step cache wraps the blocks
    rt = Runtime(loaded, family, pipelines, mode, None, adapters, token_counter(loaded.pipe),
                 config, step_cache_for(config, family, mode, group), compiled, group=group,
                 prompt_cache=prompt_cache_for(config))
    if config.enable_weight_updates:
        from diffserve.executor.weights import Weights

        rt.weights = Weights(loaded.pipe, resolve_model(config.model), loaded.device, loaded.dtype)
    rt.info = rt.describe()
    if not config.skip_startup_check:
        _check(rt, config)
    warm_up(rt)
    memory_budget.bound(rt, config)
    return rt


def _check(rt: Runtime, config: ServerConfig) -> None:
    """The start-up checks (:mod:`~diffserve.executor.self_check`), or their verdict from an
    earlier start of the same model and code (:mod:`~diffserve.executor.check_verdicts`)."""
    import torch

    key = check_verdicts.key_for(resolve_model(config.model), {
        "device": torch.device(rt.loaded.device).type, "dtype": rt.loaded.dtype,
        "mode": rt.mode, "requested": config.batching_mode, "tasks": sorted(rt.pipelines),
        "samplers": rt.info.schedulers, "compile": config.compile,
        "step_cache": config.step_cache, "quantization": config.quantization,
        "text_encoder_quantization": config.text_encoder_quantization,
        "layout": MemoryLayout.of(config).describe(),
        "adapters": sorted(config.lora_adapters.items())})
    verdict = check_verdicts.recall(key)
    if rt.group is not None:  # every rank runs the checks' forwards together, or none does
        verdict = rt.group.broadcast(verdict)
    if verdict is not None:
        log.info("start-up checks: the verdict of an earlier start of this model and code")
    else:
        found = self_check.check(rt)
        verdict = {"unavailable": found.unavailable, "fallback": found.fallback}
    apply_verdicts(rt, config, verdict["unavailable"], verdict["fallback"])
    if rt.info.schedulers:
        if "samplers" not in verdict:
            task = self_check.checked_tasks(rt)[0]
            verdict["samplers"] = self_check.samplers(rt, rt.info.schedulers, task,
                                                      rt.task_modes[task] == STEP_MODE)
        working, failing = verdict["samplers"]
        for name, reason in failing.items():
            log.info("sampler %s is not offered: %s", name, reason)
        rt.info = dataclasses.replace(rt.info, schedulers=list(working))
    check_verdicts.remember(key, verdict)


def apply_verdicts(rt: Runtime, config: ServerConfig, unavailable: dict[str, str],
                   fallback: dict[str, str]) -> None:
    """Serve what the checks allow: a task whose plain pipeline fails is not offered; a task the
    step engine gets wrong runs in request mode, the others keep step mode. Rollouts sample on
    the step engine's generation, so they go where generation cannot run in it. Raises where
    nothing can be served, or where --batching-mode step finds no task for the step engine."""
    from diffserve.tasks import GENERATE

    unavailable, fallback = dict(unavailable), dict(fallback)
    if rt.group is not None:  # a group runs the step engine only
        unavailable.update({task: f"{why}, and request mode does not run in a parallel group"
                            for task, why in fallback.items()})
        fallback = {}
    for task in [t for t in rt.pipelines if TASKS[t].trajectory]:
        why = unavailable.get(GENERATE.name) or fallback.get(GENERATE.name)
        if why is not None:
            unavailable[task] = f"rollouts sample on the step engine's generation, and {why}"
    checked = [t for t in rt.pipelines if not TASKS[t].trajectory]
    if checked and all(t in unavailable for t in checked):
        raise RuntimeError("no task of this model can be served: " + _reasons(unavailable))
    for task, why in unavailable.items():
        log.warning("task %s is not served: %s", task, why)
        rt.pipelines.pop(task, None)
    rt.unavailable, rt.fallback = unavailable, {t: w for t, w in fallback.items()
                                                if t in rt.pipelines}
    if rt.mode == STEP_MODE and all(t in rt.fallback for t in checked if t in rt.pipelines):
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


def prompt_cache_for(config: ServerConfig):
    if not config.prompt_cache_bytes:
        return None
    from diffserve.executor.prompt_cache import PromptCache

    return PromptCache(config.prompt_cache_bytes)


def load_adapters(pipe, config: ServerConfig, on_event):
    """The LoRA adapters, the --lora-modules ones loaded and checked; None where the server
    serves none (nothing of PEFT is then imported or hooked)."""
    if not config.serves_adapters:
        return None
    from diffserve.executor.adapters import AdapterError, AdapterStore

    store = AdapterStore(pipe, config.max_loras, config.max_lora_rank, on_event)
    for name, path in config.lora_adapters.items():
        try:
            store.add(name, path)
        except AdapterError as error:
            raise RuntimeError(f"LoRA adapter {name!r} (--lora-modules): {error}") from None
    return store
