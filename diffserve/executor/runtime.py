"""A model ready to serve, built in one place: load the pipeline, pick the family and the
batching mode, build each task's pipeline, load the LoRA adapters, and describe it all for the
frontend. The executor process, ``diffserve calibrate`` and the offline benchmark all start here,
so what they measure is what the server runs."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

from diffserve.config.flags import ServerConfig
from diffserve.executor.accel import attention, flops, quantized
from diffserve.executor.accel.setup import compiled_for, step_cache_for, warm_up
from diffserve.executor.checks import apply as checks
from diffserve.executor.checks import verdicts
from diffserve.executor.control.models import control_paths, load_controls
from diffserve.executor.families.known import family_for, published_dtype, resolve_mode
from diffserve.executor.lora.store import served_adapters
from diffserve.executor.memory import budget
from diffserve.executor.memory.layout import MemoryLayout
from diffserve.executor.model.info import model_info, token_counter
from diffserve.executor.model.loading import LoadedModel, load_model, quiet_imports
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.parallel.model import parallelize, tensor_parallel_denoisers
from diffserve.executor.pipeline import pipeline_class_of
from diffserve.executor.request.runner import RequestRunner
from diffserve.executor.rl.weights import Weights
from diffserve.executor.step.engine import StepEngine
from diffserve.executor.step.prompt_cache import PromptCache
from diffserve.builders.registry import resolve_model
from diffserve.policies import set_policy
from diffserve.wire.protocol import REQUEST_MODE, STEP_MODE
from diffserve.wire.tasks import GENERATE, TASKS
from diffserve.wire.request import WITH_CONTROLS
from diffserve.wire.model_info import ModelInfo

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
    # What the start-up checks decided, per task (diffserve.executor.checks.startup): the tasks
    # served in request mode although the executor runs the step engine, and the tasks not
    # served at all; each with why.
    fallback: dict[str, str] = dataclasses.field(default_factory=dict)
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)
    group: Any = None  # the parallel group this process is a rank of (diffserve.executor.parallel.topology)
    prompt_cache: Any = None  # diffserve.executor.step.prompt_cache.PromptCache, where one is kept
    weights: Any = None  # diffserve.executor.rl.weights.Weights, with --enable-weight-updates
    controls: Any = None  # diffserve.executor.control.models.ControlModels, where any are served
    # What was chosen and measured for speed (the attention backend, quantization, FLOPs), as
    # /v1/models shows it.
    speed: dict[str, Any] = dataclasses.field(default_factory=dict)
    flops: Any = None  # the denoiser's FlopModel (diffserve.executor.accel.flops), where fitted

    @property
    def task_modes(self) -> dict[str, str]:
        """The batching mode of each task served, and of each task served with controls (its
        mode key ``TASK+controls``) where control models are served."""
        keys = [*self.pipelines, *(task + WITH_CONTROLS for task in self.pipelines
                                   if self.controls and task + WITH_CONTROLS not in self.unavailable
                                   and self._controlled(task))]
        return {key: REQUEST_MODE if self.mode == REQUEST_MODE or key in self.fallback
                or key.split("+")[0] in self.fallback else STEP_MODE for key in keys}

    @property
    def mixed_sizes(self) -> dict[str, str]:
        """Each step-mode task (mode key) and whether its requests of different sizes share a
        forward: "" where they do, else why not (docs/batching.md, "Sizes in one forward")."""
        family = self.family
        why = ("--size-mixing off" if self.config.size_mixing == "off"
               else None if family is None else family.mixes_sizes_now())
        why = why or ("--compile" if self.compiled is not None else
                      "a parallel group" if self.group is not None else
                      # a row's cells in the union grid are not its leading tokens
                      "--step-cache over rows laid out in one grid" if self.step_cache is not None
                      and family.mixes_in_grid else "")
        return {key: ("controls" if key.endswith(WITH_CONTROLS) and not (
                          family and family.mixes_controls) else
                      "reference images" if TASKS[key.split("+")[0]].references and not (
                          family and family.mixes_references) else why)
                for key, mode in self.task_modes.items() if mode == STEP_MODE}

    def _controlled(self, task: str) -> bool:
        """Whether ``task`` takes controls: where diffusers has a ControlNet pipeline for it (the
        reference), and rollouts where generation takes them (they sample on it)."""
        pipelines = self.family.control_pipelines
        return task in pipelines or (TASKS[task].trajectory and GENERATE.name in pipelines)

    def describe(self) -> ModelInfo:
        """The model info of what is served now."""
        info = model_info(self.loaded, self.config, self.mode, type(self.family) if self.family
                          else None, list(self.pipelines),
                          list(self.adapters.current) if self.adapters else [],
                          self.task_modes, self.unavailable, self.group,
                          self.controls.describe() if self.controls else [])
        return dataclasses.replace(info, speed=dict(self.speed), mixed_sizes=self.mixed_sizes,
                                   mixed_in_grid=bool(self.family and self.family.mixes_in_grid),
                                   row_cost=flops.row_cost(self.flops, info))

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
        kwargs.setdefault("policy", set_policy(self.config.set_policy_name))
        kwargs.setdefault("prompt_cache", self.prompt_cache)
        if self.compiled is not None:
            kwargs.setdefault("text_multiple", self.compiled.text_multiple(self.family))
        kwargs.setdefault("mixed_sizes", frozenset(
            key for key, why in self.mixed_sizes.items() if not why))
        return StepEngine(self.family, self.count_tokens, adapters=self.adapters,
                          step_cache=self.step_cache, cache_threshold=self.config.cache_threshold,
                          group=self.group, **kwargs)

    def request_runner(self, should_interrupt=lambda: False, emit_partial=lambda partial: None,
                       emit_progress=lambda *progress: None):
        return RequestRunner(self.loaded, self.pipelines, self.family, self.count_tokens,
                             should_interrupt, emit_partial, self.adapters, emit_progress)


def build_runtime(config: ServerConfig, device: str | None = None, torch_threads: int = 0,
                  index: int = 0, on_adapter_event=lambda event, **kw: None,
                  group=None) -> Runtime:
    """The model of ``config`` on ``device`` (default ``config.device``), ready to serve;
    ``group``: the parallel group this process is a rank of (every rank builds the same).
    Raises where it cannot serve as configured (an unknown family with --batching-mode step,
    an adapter that does not load, no task that can be served, a group the model cannot run)."""
    quiet_imports()  # before anything imports diffusers (the model directory may be built first)
    tensor_parallel = group is not None and group.degrees.tp > 1
    loaded = load_model(config.model, device or config.device, config.dtype, torch_threads, index,
                        config.quantization,
                        (lambda path, dtype: tensor_parallel_denoisers(path, group, dtype))
                        if tensor_parallel else None, MemoryLayout.of(config),
                        config.text_encoder_quantization,
                        published_dtype(pipeline_class_of(resolve_model(config.model))),
                        config.quantization_scope)
    family_cls = family_for(loaded.pipeline_class)
    mode = resolve_mode(config.batching_mode, family_cls, loaded.pipeline_class)
    pipelines = task_pipelines(loaded.pipe, family_cls)
    family = family_cls(loaded.pipe, pipelines, loaded.call_kwargs) if family_cls else None
    controls = load_controls(control_paths(config, loaded), family, loaded.device,
                             loaded.pipe.dtype)
    if family is not None:
        family.controls = controls
    if group is not None:
        parallelize(loaded.pipe, family, group)
    rt = Runtime(loaded, family, pipelines, mode, None, None, token_counter(loaded.pipe),
                 config, group=group, prompt_cache=PromptCache(config.prompt_cache_bytes)
                 if config.prompt_cache_bytes else None, controls=controls)
    rt.info = rt.describe()
    rt.flops = _flop_model(rt, config)  # on the plain model: torch's counter sees its matmuls
    rt.speed["flops"] = flops.describe(rt, config)
    rt.speed["quantization"] = quantized.quantize(rt, config)  # before PEFT wraps the layers
    rt.adapters = adapters = served_adapters(loaded.pipe, config, on_adapter_event)
    # Timed on the plain blocks, before compilation and the step cache wrap them (in this order).
    rt.speed["attention"] = attention.choose(rt, config.attention_backend).describe()
    rt.compiled = compiled_for(config, loaded, family)
    rt.step_cache = step_cache_for(config, family, mode, group)
    if config.enable_weight_updates:
        rt.weights = Weights(loaded.pipe, resolve_model(config.model), loaded.device, loaded.dtype,
                             lambda: {f"controlnet {name}": m.module
                                      for name, m in (controls.models.items() if controls else ())},
                             lambda: [c for c in (rt.prompt_cache, adapters and adapters.rows.gathered)
                                      if c])
    rt.info = rt.describe()
    if not config.skip_startup_check:
        checks.check(rt, config)
    warm_up(rt)
    budget.bound(rt, config)
    return rt


def _flop_model(rt, config: ServerConfig):
    """The denoiser's FLOP model: fitted (:func:`~diffserve.executor.accel.flops.fit`, a second
    or so of small generations), or remembered from an earlier start of the same model files,
    code and group shape (FLOPs depend on no device or dtype). A group's ranks all take the
    leader's answer: a fit runs forwards, whose collectives every rank must meet."""
    key = verdicts.key_for(resolve_model(config.model), {
        "flops": rt.loaded.pipeline_class, "degrees": vars(config.degrees),
        # The scheme decides which matmuls the fit sees (quantized as the weights load).
        "quantization": [config.quantization, config.quantization_scope]})
    found = verdicts.recall(key, "model-flops")
    if rt.group is not None:
        found = rt.group.broadcast(found)
    if found is not None:
        return flops.FlopModel(**found) if found else None
    model = flops.fit(rt)
    verdicts.remember(key, dataclasses.asdict(model) if model is not None else {}, "model-flops")
    return model
