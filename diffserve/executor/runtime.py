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
from diffserve.executor import check_verdicts, self_check
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
from diffserve.models.registry import resolve_model
from diffserve.protocol import REQUEST_MODE, STEP_MODE, ModelInfo

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    loaded: LoadedModel
    family: Any  # the step engine's family (an instance), None where it does not know the pipeline
    pipelines: dict[str, Any]  # task name -> its pipeline
    mode: str  # the batching mode it serves in
    info: ModelInfo
    adapters: Any  # the AdapterStore, None where the server serves no adapters
    count_tokens: Callable[[str], int]
    config: ServerConfig
    step_cache: Any = None  # over the family's denoisers, where --step-cache runs
    compiled: Any = None  # the denoisers' compiled blocks, where --compile runs

    def step_engine(self, **kwargs):
        """A step engine over this model, with the configured set policy."""
        from diffserve.executor.step_engine import StepEngine
        from diffserve.policies import set_policy

        return StepEngine(self.family, self.count_tokens, adapters=self.adapters,
                          policy=set_policy(self.config.set_policy), step_cache=self.step_cache,
                          cache_threshold=self.config.cache_threshold, **kwargs)

    def request_runner(self, should_interrupt=lambda: False, emit_partial=lambda partial: None,
                       emit_progress=lambda *progress: None):
        from diffserve.executor.request_runner import RequestRunner

        return RequestRunner(self.loaded, self.pipelines, self.family, self.count_tokens,
                             should_interrupt, emit_partial, self.adapters, emit_progress)


def build_runtime(config: ServerConfig, device: str | None = None, torch_threads: int = 0,
                  index: int = 0, on_adapter_event=lambda event, **kw: None) -> Runtime:
    """The model of ``config`` on ``device`` (default ``config.device``), ready to serve.
    Raises where it cannot serve as configured (an unknown family with --batching-mode step,
    an adapter that does not load)."""
    from diffserve.executor.families import family_for

    loaded = load_model(config.model, device or config.device, config.dtype, torch_threads, index,
                        config.quantization)
    family_cls = family_for(loaded.pipeline_class)
    mode = resolve_mode(config.batching_mode, family_cls, loaded.pipeline_class)
    pipelines = task_pipelines(loaded.pipe, family_cls)
    family = family_cls(loaded.pipe, pipelines, loaded.call_kwargs) if family_cls else None
    adapters = load_adapters(loaded.pipe, config, on_adapter_event)
    compiled = compiled_for(config, loaded, family)  # before the step cache wraps the blocks
    describe = lambda mode: model_info(  # noqa: E731
        loaded, config, mode, family_cls, list(pipelines), list(adapters.current) if adapters else [])
    rt = Runtime(loaded, family, pipelines, mode, describe(mode), adapters,
                 token_counter(loaded.pipe), config, step_cache_for(config, family, mode),
                 compiled)
    if not config.skip_startup_check:
        _check(rt, config, describe)
    warm_up(rt)
    return rt


def _check(rt: Runtime, config: ServerConfig, describe: Callable[[str], ModelInfo]) -> None:
    """The start-up checks (:mod:`~diffserve.executor.self_check`), or their verdict from an
    earlier start of the same model and code (:mod:`~diffserve.executor.check_verdicts`)."""
    import torch

    key = check_verdicts.key_for(resolve_model(config.model), {
        "device": torch.device(rt.loaded.device).type, "dtype": rt.loaded.dtype,
        "mode": rt.mode, "requested": config.batching_mode, "tasks": sorted(rt.pipelines),
        "samplers": rt.info.schedulers, "compile": config.compile,
        "step_cache": config.step_cache, "quantization": config.quantization,
        "adapters": sorted(config.lora_adapters.items())})
    verdict = check_verdicts.recall(key)
    if verdict is not None:
        log.info("start-up checks: the verdict of an earlier start of this model and code")
    else:
        verdict = {"step": self_check.check(rt) if rt.mode == STEP_MODE else None}
    why = verdict["step"]
    if why is not None:
        if config.batching_mode == STEP_MODE:
            raise UnsupportedMode(f"--batching-mode step: on this model the step engine does "
                                  f"not match the plain pipeline ({why}); use "
                                  "--batching-mode request (or auto)")
        log.warning("serving in request mode: the start-up check found that on this model "
                    "the step engine does not match the plain pipeline (%s)", why)
        rt.mode, rt.info = REQUEST_MODE, describe(REQUEST_MODE)
        if rt.step_cache is not None:
            log.warning("--step-cache runs in step mode only: serving without it")
            rt.step_cache.close()
            rt.step_cache = None
    if rt.info.schedulers:
        if "samplers" not in verdict:
            verdict["samplers"] = self_check.samplers(rt, rt.info.schedulers)
        working, failing = verdict["samplers"]
        for name, reason in failing.items():
            log.info("sampler %s is not offered: %s", name, reason)
        rt.info = dataclasses.replace(rt.info, schedulers=list(working))
    check_verdicts.remember(key, verdict)


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
