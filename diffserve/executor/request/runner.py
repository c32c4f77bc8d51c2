"""Request mode: one batched call of the loaded pipeline (or of the pipeline of the batch's task,
such as image-to-image or inpainting) per batch.

Works with any diffusers text-to-image pipeline that takes a prompt list and a generator list;
what a pipeline accepts is read off its ``__call__`` signature, not from a list of families.
Torch runs on the thread that built the pipeline: on small CPU machines a pipeline call from a
pool thread was measured at nearly three times the time of the same call on the loading thread.
"""

from __future__ import annotations

import inspect
import logging
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable

import numpy as np

from diffserve.wire.costs import WITH_NEGATIVE
from diffserve.executor.memory import oom as memory
from diffserve.executor.lora.store import AdapterStore
from diffserve.executor.families.base import BY_MODEL, BY_ROW, SHARED, Family
from diffserve.executor.families.control_hooks import control_kwargs
from diffserve.executor.families.schedulers import PIPELINE_LOCK, scheduler_swapped
from diffserve.executor.families.outputs import NonFiniteOutput, split_finite, to_uint8
from diffserve.executor.model.loading import LoadedModel
from diffserve.executor.model.samplers import build as build_sampler
from diffserve.executor.pipeline import guidance_on_guider, size_as_asked
from diffserve.executor.results import Outcome, PartialImage, partial_steps
from diffserve.wire.request import Work, WorkItem
from diffserve.wire.tasks import REFERENCE
from diffserve.wire.samples import CONTROLS, generators, group_by, input_arrays, isolate

log = logging.getLogger(__name__)

Pair = tuple[WorkItem, list[Any]]  # a work item and its input frames


class OutputSizeError(RuntimeError):
    """The pipeline made images of another size than the one asked for."""


class RequestRunner:
    def __init__(self, loaded: LoadedModel, pipelines: dict[str, Any], family: Family | None,
                 count_tokens: Callable[[str], int] = lambda p: 0,
                 should_interrupt: Callable[[], bool] = lambda: False,
                 emit_partial: Callable[[PartialImage], None] = lambda partial: None,
                 adapters: AdapterStore | None = None,
                 emit_progress: Callable[[str, int, int], None] = lambda *progress: None) -> None:
        """``pipelines``: task name -> pipeline (the loaded one for generation). ``family`` only
        decodes previews (None: no previews). ``should_interrupt`` is asked at every denoising
        step whether every caller of the running call has gone; ``emit_partial`` sends a preview
        at once. ``adapters``: the LoRA adapters (a call applies its requests' one stack)."""
        import torch

        self.torch = torch
        self.loaded = loaded
        self.pipelines = pipelines
        self.accepts = {task: frozenset(inspect.signature(p.__call__).parameters)
                        for task, p in pipelines.items()}
        self.family = family
        self.count_tokens = count_tokens
        self.should_interrupt = should_interrupt
        self.emit_partial = emit_partial
        self.emit_progress = emit_progress  # (request id, steps done, total) of a video
        self.adapters = adapters
        # Pipelines that encode a missing negative prompt as zeros, not as "", or that guide only
        # with one: a call must not mix requests with and without one, or those without change.
        self.split_negatives = bool(getattr(loaded.pipe.config, "force_zeros_for_empty_prompt", False)
                                    or (family and family.guidance_rule == WITH_NEGATIVE))
        self.guidance_kwarg = family.guidance_kwarg if family else "guidance_scale"
        self._interrupted = False
        self._sent: set[tuple[str, int, int]] = set()  # previews streamed during this batch
        self._samplers: dict[str, Any] = {}  # name -> the scheduler for calls that pick it

    def execute(self, work: Work, inputs: list[list[Any]]) -> list[Outcome]:
        """Run a batch. If the batched call raises, run each request alone so that only the
        request that causes the error fails; a preview streamed before the retry is not sent
        again."""
        start = time.perf_counter()
        self._interrupted, self._sent = False, set()
        if work.items[0].request.task_spec.trajectory:
            return self._rollouts(work, inputs, start)
        pairs = list(zip(work.items, inputs))
        results = isolate(pairs, self._call_all, lambda pair: pair[0].request.request_id,
                          f"batch {work.work_id}", memory.release)
        elapsed = time.perf_counter() - start
        if self._interrupted:
            return [Outcome.cancelled(item, elapsed) for item in work.items]
        return [Outcome.failed(item, images, elapsed) if isinstance(images, Exception)
                else Outcome.made(item, images, elapsed, self.count_tokens(item.request.prompt))
                for (item, _), images in results]

    def _rollouts(self, work: Work, inputs: list[list[Any]], start: float) -> list[Outcome]:
        """Rollouts record every step of a stochastic sampler, which no pipeline call does: the
        batch runs through the step engine, all of it in each forward, until it is done."""
        from diffserve.executor.step.engine import StepEngine

        if self.family is None:
            raise ValueError("rollouts need a family the step engine knows")
        engine = StepEngine(self.family, self.count_tokens, adapters=self.adapters)
        outcomes = engine.admit(work.items, inputs)
        while engine:
            if self.should_interrupt():
                engine.cancel([item.request.request_id for item in work.items])
            outcomes += engine.step().finished
        elapsed = time.perf_counter() - start
        for o in outcomes:
            o.execution_s = elapsed
        return outcomes

    def _call_all(self, pairs: list[Pair]) -> list[np.ndarray]:
        """Each pair's images, in as few pipeline calls as the pipeline allows."""
        if self._interrupted:  # every caller left during an earlier call: nothing to retry
            return [np.empty(0)] * len(pairs)
        negatives, alone = self.split_negatives, self._one_request_a_call(pairs[0][0].request)
        key = lambda pair: (negatives and bool(pair[0].request.negative_prompt),  # noqa: E731
                            alone and pair[0].request.request_id)
        images: dict[int, np.ndarray] = {}
        for group in group_by(pairs, key).values():
            images.update(zip(map(id, group), self._call(group)))
        return [images[id(pair)] for pair in pairs]

    def _one_request_a_call(self, request) -> bool:
        """A pipeline that takes one set of references, one first frame, or one image per stacked
        control model for the whole call (not one per prompt row) runs one request a call; an
        edit is called as for one prompt."""
        return bool(self.family is not None and (
            (not self.family.references_per_row and request.task_spec.references)
            or (len(request.controls) > 1
                and self.family.control_stacks.get(request.task) == SHARED))
        ) or request.task_spec.first_frame

    def _call(self, pairs: list[Pair]) -> list[np.ndarray]:
        """One pipeline call for these items; each item's images."""
        from PIL import Image

        first = pairs[0][0].request
        pipe, accepts = self.pipelines[first.task], self.accepts[first.task]
        if first.controls:  # the family's ControlNet pipeline, with the call's control models
            pipe = self.family.control_pipeline(first.task, tuple(c.model for c in first.controls))
            accepts = frozenset(inspect.signature(pipe.__call__).parameters)
        samples = [(item, i) for item, _ in pairs for i in range(item.start, item.stop)]
        kwargs = {k: v for k, v in self.loaded.call_kwargs.items() if k in accepts}
        kwargs.update(
            prompt=[item.request.prompt for item, _ in samples],
            # One generator per image, so every sample depends on its own seed only.
            generator=[g for item, _ in pairs for g in generators(item.request, item.start, item.stop)],
            num_inference_steps=first.num_inference_steps, output_type="np")
        if "height" in accepts:
            kwargs.update(height=first.height, width=first.width)
        if self.guidance_kwarg in accepts:
            kwargs[self.guidance_kwarg] = first.guidance_scale
        if "negative_prompt" in accepts and any(item.request.negative_prompt for item, _ in samples):
            kwargs["negative_prompt"] = [item.request.negative_prompt for item, _ in samples]
        if first.num_frames:
            kwargs["num_frames"] = first.num_frames
            if first.guidance_scale_2 is not None and "guidance_scale_2" in accepts:
                kwargs["guidance_scale_2"] = first.guidance_scale_2
        if self._one_request_a_call(first) and first.task_spec.references:
            kwargs.update(prompt=first.prompt, num_images_per_prompt=len(samples))
            if "negative_prompt" in kwargs:
                kwargs["negative_prompt"] = first.negative_prompt
        arrays = [input_arrays(item.request, frames) for item, frames in pairs]
        if first.task_spec.first_frame:  # one image for the call (one request, one video)
            kwargs["image"] = Image.fromarray(arrays[0]["image"])
        elif first.task_spec.inputs:
            kwargs["strength"] = first.strength
            for spec in first.task_spec.inputs:
                kwargs[spec.name] = [Image.fromarray(a[spec.name]) for a, (item, _) in
                                     zip(arrays, pairs) for _ in range(item.samples)]
        if self.family is not None:
            references = ([[Image.fromarray(r) for r in a[REFERENCE.name]] for a, (item, _) in
                           zip(arrays, pairs) for _ in range(item.samples)]
                          if first.task_spec.references else None)
            kwargs.update(self.family.request_kwargs(first.task_spec, first.width, first.height,
                                                     references))
        if first.controls:
            kwargs.update(self._control_kwargs(first, arrays, pairs))
        if "callback_on_step_end" in accepts:
            kwargs["callback_on_step_end"] = self._step_callback(samples)
        with (PIPELINE_LOCK, self.torch.inference_mode(), self._adapters(first.loras),
              self._sampler(pipe, first), guidance_on_guider(pipe, first.guidance_scale),
              size_as_asked(pipe, first.width, first.height)):
            output = pipe(**kwargs)
        # Video pipelines answer frames (k, frames, H, W, 3) where image ones answer images.
        made = np.asarray(output.frames if first.num_frames else output.images)
        check_output(made, len(samples), first.width, first.height, type(pipe).__name__,
                     first.num_frames)
        # An item with a non-finite image gets its error as its result; the others their pixels.
        return split_finite(lambda: to_uint8(made), [item.samples for item, _ in pairs])

    def _control_kwargs(self, first, arrays: list, pairs: list[Pair]) -> dict[str, Any]:
        """A ControlNet pipeline's keywords: each control's images, one per row, and its scale,
        window and mode (one control as itself, several as lists, as diffusers takes them; the
        call's requests share their controls but for the images)."""
        from PIL import Image

        controls = first.controls
        images = [[Image.fromarray(a[CONTROLS][c]) for a, (item, _) in zip(arrays, pairs)
                   for _ in range(item.samples)] for c in range(len(controls))]
        one = len(controls) == 1
        stacks = self.family.control_stacks.get(first.task, BY_MODEL)
        if not one and stacks == BY_ROW:
            images = [list(row) for row in zip(*images)]
        elif not one and stacks == SHARED:  # one request a call: its rows share its images
            images = [model[0] for model in images]
        return control_kwargs(self.family.control_image_kwarg[first.task], controls, images)

    def _sampler(self, pipe, request):
        """The call with the request's sampler (a batch shares it: it is a call field) in place
        of the pipeline's scheduler."""
        if not request.scheduler:
            return nullcontext()
        if request.scheduler not in self._samplers:
            self._samplers[request.scheduler] = build_sampler(self.loaded.pipe.scheduler,
                                                              request.scheduler)
        return scheduler_swapped(pipe, self._samplers[request.scheduler])

    @contextmanager
    def _adapters(self, loras):
        """Every row of the call (the text encoders' too) with the batch's one adapter stack,
        in the versions current now, held for the call."""
        if not loras:
            yield
            return
        if self.adapters is None:
            raise ValueError("this server serves no LoRA adapters")
        stack = self.adapters.acquire(loras)
        if stack is None:  # nothing is held between calls, so the budget always has room
            raise RuntimeError(f"adapters {[n for n, _ in loras]} do not fit --max-loras")
        try:
            with self.adapters.rows.uniform(stack):
                yield
        finally:
            self.adapters.release(stack)

    def _step_callback(self, samples: list[tuple[WorkItem, int]]):
        wanted = any(item.request.partial_images for item, _ in samples) and self.family is not None
        reporting = {item.request.request_id for item, _ in samples if item.request.progress}

        def on_step_end(pipe, step, timestep, callback_kwargs):
            if self.should_interrupt():
                self._interrupted = True
                pipe._interrupt = True
                return callback_kwargs
            if wanted:
                self._partials(pipe, step + 1, samples, callback_kwargs["latents"])
            for request_id in reporting:
                self.emit_progress(request_id, step + 1, pipe.num_timesteps)
            return callback_kwargs

        return on_step_end

    def _partials(self, pipe, done: int, samples, latents) -> None:
        total = pipe.num_timesteps
        due = []
        for row, (item, i) in enumerate(samples):
            index = partial_steps(item.request.partial_images, total).get(done)
            if index is not None and (item.request.request_id, i, index) not in self._sent:
                due.append((row, item, i, index))
        if not due:
            return
        first = samples[0][0].request
        try:
            pixels = self.family.decode(latents[[row for row, *_ in due]], first.width,
                                        first.height, first.task_spec)
        except NonFiniteOutput as bad:  # no preview of those; their final decode fails them
            pixels = [None if j in bad.rows else image for j, image in enumerate(bad.pixels)]
        for (_, item, i, index), image in zip(due, pixels):
            if image is None:
                continue
            self.emit_partial(PartialImage(item.request.request_id, i, index, image))
            self._sent.add((item.request.request_id, i, index))


def check_output(images: np.ndarray, count: int, width: int, height: int, pipeline: str,
                 frames: int = 0) -> None:
    """A pipeline must give ``count`` images (videos of ``frames`` frames) of exactly the
    requested size: a server that answered with another size would hand out wrong pixels."""
    if images.ndim != (5 if frames else 4) or images.shape[0] != count:
        raise OutputSizeError(f"{pipeline} returned {images.shape[0] if images.ndim else 0} "
                              f"{'videos' if frames else 'images'} for {count} samples")
    if frames and images.shape[1] != frames:
        raise OutputSizeError(f"{pipeline} returned {images.shape[1]} frames for a "
                              f"{frames}-frame request")
    if images.shape[-3:-1] != (height, width):
        raise OutputSizeError(f"{pipeline} returned {images.shape[-2]}x{images.shape[-3]} images "
                              f"for a {width}x{height} request")
