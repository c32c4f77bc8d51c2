"""What a family declares and does for ControlNet (:mod:`diffserve.executor.control`), as a base
of :class:`~diffserve.executor.families.base.Family`: the control models it takes, the diffusers
ControlNet pipelines that run its tasks with them (request mode, the start-up check), and how a
control image and a control model's call look for its denoiser. A family that takes none leaves
it all at its defaults."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from diffserve.executor.families.conditioning import Conditioning
from diffserve.executor.pipeline import built_from

CONTROL_PIPES_KEPT = 16  # ControlNet pipelines kept built (request mode): task x model stacks


def control_kwargs(keyword: str, controls, images: list) -> dict[str, Any]:
    """A diffusers ControlNet pipeline call's keywords for the stack ``controls``
    (:class:`~diffserve.wire.request.Control`): ``images`` (one entry a control model, as the pipeline
    takes its images) under ``keyword``, and each control's scale, window and mode; one control
    as itself, several as lists, as diffusers takes them. Request mode and the reference oracle
    both call it."""
    one = len(controls) == 1
    pick = (lambda values: values[0]) if one else list  # noqa: E731
    kwargs = {keyword: images[0] if one else images,
              "controlnet_conditioning_scale": pick([c.scale for c in controls]),
              "control_guidance_start": pick([c.start for c in controls]),
              "control_guidance_end": pick([c.end for c in controls])}
    if any(c.mode is not None for c in controls):
        kwargs["control_mode"] = pick([c.mode for c in controls])
    return kwargs


class ControlHooks:
    # The control model classes it takes; the diffusers pipeline that runs each task with control
    # (request mode, the start-up check), the class that stacks several models in one of its
    # calls, and the keyword its control images go by there; and whether a request's residuals
    # come from its positive rows alone and serve its negative rows too (Qwen-Image's pipeline
    # runs one control pass a step) rather than each row its own.
    control_classes: ClassVar[tuple[str, ...]] = ()
    control_pipelines: ClassVar[dict[str, str]] = {}
    control_multi: ClassVar[str] = ""
    control_image_kwarg: ClassVar[dict[str, str]] = {}
    control_from_positive: ClassVar[bool] = False
    # How a diffusers call of a task's ControlNet pipeline takes a stack of several models'
    # images: a list per model of one image per row (BY_MODEL, the default), a list per row of
    # one image per model (BY_ROW), or one image per model for every row of the call (SHARED:
    # request mode then calls one request at a time).
    control_stacks: ClassVar[dict[str, str]] = {}
    # The denoiser's config entries a control model must share with it (its residuals' widths and
    # the conditioning it reads), and what the message calls the denoiser.
    control_config_keys: ClassVar[tuple[str, ...]] = ()
    denoiser_noun: ClassVar[str] = "transformer"
    controls = None  # the served ControlModels (set by the runtime where any are served)

    _control_pipes: dict[tuple, Any] | None = None  # (task, control models) -> their pipeline

    def control_pipeline(self, task: str, names: tuple[str, ...]):
        """The family's diffusers ControlNet pipeline for ``task`` with the control models
        ``names`` (stacked in diffusers' multi-ControlNet where there are several), built from
        the task's pipeline (the same components) and kept for the next call that asks."""
        import diffusers

        key = (task, names)
        if self._control_pipes is None:
            self._control_pipes = {}
        if key not in self._control_pipes:
            modules = [self.controls[name].module for name in names]
            net = modules[0] if len(modules) == 1 else getattr(diffusers, self.control_multi)(modules)
            pipe = built_from(self.pipelines[task], self.control_pipelines[task], controlnet=net)
            pipe.set_progress_bar_config(disable=True)
            while len(self._control_pipes) >= CONTROL_PIPES_KEPT:
                self._control_pipes.pop(next(iter(self._control_pipes)))
            self._control_pipes[key] = pipe
        return self._control_pipes[key]

    def control_fits(self, module) -> str | None:
        """Why control model ``module`` cannot steer this family's denoiser (None: it can)."""
        if type(module).__name__ not in self.control_classes:
            return "is no control model of this family (it takes " + (
                ", ".join(self.control_classes) or "none") + ")"
        mine, its = self.denoisers[0].config, module.config
        for key in self.control_config_keys:
            if mine.get(key) != its.get(key):
                return (f"was made for a {self.denoiser_noun} whose {key} is {its.get(key)!r} "
                        f"(this one's: {mine.get(key)!r})")
        return None

    def control_depth(self, module) -> tuple:
        """Which denoiser blocks the model's residuals go to: models of one depth stack."""
        return ()

    def control_condition(self, module, image: np.ndarray, width: int, height: int, k: int,
                          dtype, generators: list):
        """A control image (uint8, height x width x 3, fitted to the request's size) as ``module``
        takes it, ``k`` rows, as the family's ControlNet pipeline prepares it."""
        raise NotImplementedError(f"{self.name} takes no control model")

    def control_call(self, module, latents, timesteps, cond: Conditioning, guidance,
                     control_cond, modes, width: int, height: int) -> tuple[list, ...]:
        """``module`` over these rows: its residuals unscaled, as lists of tensors in the order
        the denoiser takes them (:meth:`forward`'s ``control``)."""
        raise NotImplementedError(f"{self.name} takes no control model")
