"""The noise schedulers a request may pick (its ``scheduler`` field), by name.

Each name is a diffusers scheduler class with options, built from the loaded pipeline's own
scheduler config (its training betas, timestep spacing, prediction type...), so it samples the
same model differently, never a different model. A model offers the names whose class diffusers
declares compatible with its scheduler (``scheduler.compatibles``) and that the step engine is
tested with, each equal to the plain pipeline with that scheduler set.
"""

from __future__ import annotations

# name -> (diffusers class, options over the model's scheduler config)
SAMPLERS: dict[str, tuple[str, dict]] = {
    "ddim": ("DDIMScheduler", {}),
    "pndm": ("PNDMScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler-ancestral": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "dpm++2m": ("DPMSolverMultistepScheduler", {}),
    "dpm++2m-karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "dpm++2m-sde-karras": ("DPMSolverMultistepScheduler",
                           {"algorithm_type": "sde-dpmsolver++", "use_karras_sigmas": True}),
    "unipc": ("UniPCMultistepScheduler", {}),
    "deis": ("DEISMultistepScheduler", {}),
    "flow-euler": ("FlowMatchEulerDiscreteScheduler", {}),
}


def offered(scheduler) -> list[str]:
    """The names a model whose scheduler is ``scheduler`` offers."""
    classes = {type(scheduler).__name__, *(c.__name__ for c in getattr(scheduler, "compatibles", ()))}
    return [name for name, (cls, _) in SAMPLERS.items() if cls in classes]


def build(base, name: str):
    """Scheduler ``name`` over ``base``'s config."""
    import diffusers

    cls, options = SAMPLERS[name]
    return getattr(diffusers, cls).from_config(base.config, **options)


# Rollouts' stochastic sampler (diffserve.executor.step.rollout) replaces this scheduler's steps:
# its sigmas and Euler step are what its SDE generalises; any other scheduler's steps would not match its log-probabilities.
SAMPLES_WITH = "FlowMatchEulerDiscreteScheduler"


def samples_with(scheduler) -> bool:
    """Whether rollouts can be sampled on a pipeline with this scheduler."""
    return type(scheduler).__name__ == SAMPLES_WITH
