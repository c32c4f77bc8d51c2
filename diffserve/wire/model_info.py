"""What an executor says of the model it serves (:class:`ModelInfo`): what the frontend validates
requests against, what the scheduler admits by, and what ``/v1/models`` shows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diffserve.wire.costs import ABOVE_ONE


@dataclass(frozen=True)
class Component:
    """A pipeline component where it sits: its name, device, the rank of a parallel group that
    holds it (0 without one), its dtype and the bytes its weights take there."""

    name: str
    device: str
    rank: int
    dtype: str
    bytes: int


def mode_for(task_modes: dict[str, str], key: str, default: str) -> str:
    """The batching mode of a request's mode key (:attr:`diffserve.wire.request.ImageRequest.mode_key`):
    its own where ``task_modes`` has one, else its task's, else ``default``."""
    return task_modes.get(key, task_modes.get(key.split("+")[0], default))


@dataclass(frozen=True)
class ControlModelInfo:
    """A served control model (ControlNet): its name, its class, a union model's control types
    (0: not a union model), and what it adds to an image's cost (its parameters over the
    denoiser's: it runs once a step on every row that uses it)."""

    name: str
    kind: str
    modes: int = 0
    cost: float = 0.0


@dataclass(frozen=True)
class ModelInfo:
    """What the frontend needs to validate requests against the loaded model."""

    name: str
    pipeline_class: str
    width: int
    height: int
    spatial_stride: int
    default_steps: int  # its serving default, else its pipeline's, else work.DEFAULT_STEPS
    max_steps: int  # the noise scheduler's limit (its training timesteps)
    default_guidance_scale: float
    supports_negative_prompt: bool
    device: str
    dtype: str
    batching_mode: str
    tasks: list[str]  # names in diffserve.wire.tasks.TASKS: the tasks served
    partial_images: bool  # whether streamed previews are real intermediate decodes
    family: str | None = None  # the step engine's family, where it knows the pipeline
    # When classifier-free guidance runs (diffserve.wire.costs.GUIDANCE_RULES): the frontend prices
    # requests by it without knowing the families.
    guidance_rule: str = ABOVE_ONE
    adapters: list[str] = field(default_factory=list)  # LoRA adapters served at start
    max_edit_images: int = 0  # the most input images one edit takes (0: no edits)
    schedulers: list[str] = field(default_factory=list)  # sampler names a request may pick
    # Admission by cost (diffserve.wire.costs): the bounds with their defaults resolved for this model.
    max_batch_cost: float = 0.0
    max_running_cost: float = 0.0
    # Admission by memory (diffserve.executor.memory.budget), where a budget is set: the budget,
    # the cost it allows, and what the executor holds and a unit of cost takes.
    memory_budget_bytes: int = 0
    memory_cost_bound: float = 0.0
    memory_held_bytes: int = 0
    memory_per_cost_bytes: float = 0.0
    # Videos (0 for image models): the native frame count, the VAE's temporal stride (a frame
    # count is stride x k + 1) and the frame rate a video is encoded at by default.
    num_frames: int = 0
    frame_stride: int = 1
    fps: int = 0
    guidance_scale_2: bool = False  # a two-expert model takes guidance_scale_2
    audio_sample_rate: int = 0  # a video model that makes sound (LTX-2): its track's rate
    step_cache: bool = False  # the engine runs a step cache (requests may set cache_threshold)
    # Each task's batching mode (a task the step engine gets wrong runs in request mode), and the
    # tasks the model has but cannot serve, with why (their plain pipeline fails on it).
    task_modes: dict[str, str] = field(default_factory=dict)
    # Each step-mode task and whether requests of different sizes share one forward: "" where
    # they do, else why not (a UNet family, controls, --step-cache...).
    mixed_sizes: dict[str, str] = field(default_factory=dict)
    # Where they do: each row padded to the tallest's height by the widest's width (one grid),
    # else to the longest row's tokens; admission prices the padding by the same rule.
    mixed_in_grid: bool = False
    # One denoiser row's cost against its size relative to the native one, (a, b, c) of
    # a + b*p + c*p*p (diffserve.wire.costs.RowCost; empty: by its tokens alone): fitted from
    # the model's FLOPs, attention's square included. The frontend prices requests by it, the
    # scheduler a set's padding.
    row_cost: tuple[float, ...] = ()
    unavailable_tasks: dict[str, str] = field(default_factory=dict)
    # Each executor's parallel group ({"ulysses", "ring", "cfg", "tp", "groups"}) and where its
    # components sit (one executor's view).
    parallel: dict[str, int] = field(default_factory=dict)
    components: list[Component] = field(default_factory=list)
    random_weights: bool = False  # a released architecture built with random weights (random:)
    # ControlNet: whether the family takes control models at all, and those served.
    controls_supported: bool = False
    control_models: list[ControlModelInfo] = field(default_factory=list)
    max_controls: int = 0  # --max-controls-per-request
    # What makes a step faster, as chosen and measured at start: the attention backend (and
    # auto's timings), quantization, the model's FLOPs a step (diffserve.executor.accel).
    speed: dict[str, Any] = field(default_factory=dict)

    def control_model(self, name: str) -> ControlModelInfo | None:
        return next((m for m in self.control_models if m.name == name), None)

    def mixes_sizes(self, key: str) -> bool:
        """Whether requests of mode key ``key`` (a task, with or without controls) of different
        sizes share a forward."""
        return self.mixed_sizes.get(key) == ""

    def mode_of(self, key: str) -> str:
        """The batching mode of a request's mode key (its task, or its task with controls)."""
        return mode_for(self.task_modes, key, self.batching_mode)
