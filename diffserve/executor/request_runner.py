"""Request mode: one batched call of the loaded pipeline (or of its image-to-image or inpainting
pipeline, for edits) per batch.

Works with any diffusers text-to-image pipeline that takes a prompt list and a generator list;
what a pipeline accepts is read off its ``__call__`` signature, not from a list of families.
Torch runs on the thread that built the pipeline (see DESIGN facts: pool threads are much slower).
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any, Callable

import numpy as np

from diffserve.executor.families.base import Family, to_uint8
from diffserve.executor.loading import LoadedModel
from diffserve.executor.results import CANCELLED, Outcome, Preview, describe, partial_steps
from diffserve.protocol import GENERATE, INPAINT, Work, WorkItem

log = logging.getLogger(__name__)


class OutputSizeError(RuntimeError):
    """The pipeline made images of another size than the one asked for."""


class RequestRunner:
    def __init__(self, loaded: LoadedModel, edits: dict[str, Any], family: Family | None,
                 count_tokens: Callable[[str], int] = lambda p: 0) -> None:
        import torch

        self.torch = torch
        self.loaded = loaded
        self.pipelines = {GENERATE: loaded.pipe, **edits}
        self.accepts = {task: frozenset(inspect.signature(p.__call__).parameters)
                        for task, p in self.pipelines.items()}
        self.family = family  # only to decode previews; None: no previews for this pipeline
        self.count_tokens = count_tokens
        # Pipelines that encode a missing negative prompt as zeros, not as "": a call must not
        # mix requests with and without one, or those without would change.
        self.split_negatives = bool(getattr(loaded.pipe.config, "force_zeros_for_empty_prompt", False))
        # Set by the executor loop: is every caller of the running call gone?
        self.should_interrupt: Callable[[], bool] = lambda: False
        # Set by the executor loop: send a preview at once.
        self.emit_preview: Callable[[Preview], None] = lambda preview: None

    def execute(self, work: Work, inputs: list[list[Any]]) -> list[Outcome]:
        """Run a batch. If the batched call raises, run each request alone so that only the
        request that causes the error fails."""
        start = time.perf_counter()
        items = list(zip(work.items, inputs))
        groups = [items]
        if self.split_negatives:
            groups = [g for g in ([i for i in items if i[0].request.negative_prompt],
                                  [i for i in items if not i[0].request.negative_prompt]) if g]
        try:
            images = {}
            for group in groups:
                images.update(self._call(group))
        except Exception as batch_error:  # noqa: BLE001 - isolate the culprit below
            if self._interrupted:
                return [Outcome(item, None, CANCELLED, time.perf_counter() - start)
                        for item in work.items]
            log.warning("batch %d failed (%s); retrying its requests one by one",
                        work.work_id, batch_error)
            return self._one_by_one(items, start)
        elapsed = time.perf_counter() - start
        if self._interrupted:
            return [Outcome(item, None, CANCELLED, elapsed) for item in work.items]
        return [Outcome(item, images[item.key], None, elapsed, self.count_tokens(item.request.prompt))
                for item in work.items]

    def _one_by_one(self, items, start: float) -> list[Outcome]:
        by_request: dict[str, list] = {}
        for pair in items:
            by_request.setdefault(pair[0].request.request_id, []).append(pair)
        outcomes = []
        for pairs in by_request.values():
            try:
                images = self._call(pairs)
            except Exception as error:  # noqa: BLE001 - reported to that request's caller
                outcomes.extend(Outcome(item, None, describe(error), time.perf_counter() - start)
                                for item, _ in pairs)
                continue
            outcomes.extend(Outcome(item, images[item.key], None, time.perf_counter() - start,
                                    self.count_tokens(item.request.prompt)) for item, _ in pairs)
        return outcomes

    def _call(self, pairs: list[tuple[WorkItem, list[Any]]]) -> dict[tuple[str, int], np.ndarray]:
        """One pipeline call for these items; each item's images, by item key."""
        from PIL import Image

        torch = self.torch
        first = pairs[0][0].request
        task = first.task
        pipe, accepts = self.pipelines[task], self.accepts[task]
        samples = [(item, i) for item, _ in pairs for i in range(item.start, item.stop)]
        kwargs = {k: v for k, v in self.loaded.call_kwargs.items() if k in accepts}
        kwargs.update(
            prompt=[item.request.prompt for item, _ in samples],
            # One generator per image, so every sample depends on its own seed only.
            generator=[torch.Generator("cpu").manual_seed(item.request.seed + i) for item, i in samples],
            num_inference_steps=first.num_inference_steps, output_type="np")
        if "height" in accepts:
            kwargs.update(height=first.height, width=first.width)
        if "guidance_scale" in accepts:
            kwargs["guidance_scale"] = first.guidance_scale
        if "negative_prompt" in accepts and any(item.request.negative_prompt for item, _ in samples):
            kwargs["negative_prompt"] = [item.request.negative_prompt for item, _ in samples]
        if task != GENERATE:
            frames = {item.key: frames for item, frames in pairs}
            kwargs["strength"] = first.strength
            kwargs["image"] = [Image.fromarray(np.asarray(frames[item.key][0]).reshape(
                first.height, first.width, 3)) for item, _ in samples]
            if task == INPAINT:
                kwargs["mask_image"] = [Image.fromarray(np.asarray(frames[item.key][1]).reshape(
                    first.height, first.width)) for item, _ in samples]
        if "callback_on_step_end" in accepts:
            kwargs["callback_on_step_end"] = self._step_callback(samples)
        self._interrupted = False
        with torch.inference_mode():
            images = to_uint8(pipe(**kwargs).images)
        check_output(images, len(samples), first.width, first.height, type(pipe).__name__)
        found, offset = {}, 0
        for item, _ in pairs:
            found[item.key], offset = images[offset:offset + item.size], offset + item.size
        return found

    def _step_callback(self, samples):
        wanted = any(item.request.partial_images for item, _ in samples) and self.family is not None

        def on_step_end(pipe, step, timestep, callback_kwargs):
            if self.should_interrupt():
                self._interrupted = True
                pipe._interrupt = True
            elif wanted:
                self._previews(pipe, step + 1, samples, callback_kwargs["latents"])
            return callback_kwargs

        return on_step_end

    def _previews(self, pipe, done: int, samples, latents) -> None:
        total = pipe.num_timesteps
        due = [(row, item, i, partial_steps(item.request.partial_images, total).get(done))
               for row, (item, i) in enumerate(samples)]
        due = [entry for entry in due if entry[3] is not None]
        if not due:
            return
        first = samples[0][0].request
        pixels = self.family.decode(latents[[row for row, *_ in due]], first.width, first.height,
                                    first.task)
        for (_, item, i, index), image in zip(due, pixels):
            self.emit_preview(Preview(item.request.request_id, i, index, image))

    _interrupted = False


def check_output(images: np.ndarray, count: int, width: int, height: int, pipeline: str) -> None:
    """A pipeline must give ``count`` images of exactly the requested size: a server that answered
    with another size would hand out wrong pixels."""
    if images.ndim != 4 or images.shape[0] != count:
        raise OutputSizeError(f"{pipeline} returned {images.shape[0] if images.ndim else 0} images "
                              f"for {count} samples")
    if images.shape[1:3] != (height, width):
        raise OutputSizeError(f"{pipeline} returned {images.shape[2]}x{images.shape[1]} images for "
                              f"a {width}x{height} request")
