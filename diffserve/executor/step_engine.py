"""The step engine: a running set of requests that join and leave between denoising steps.

One :meth:`StepEngine.step` is: drop what was cancelled, one batched denoiser forward that carries
every running sample at its own timestep (with its own guidance scale and negative prompt), each
request's own scheduler step, streamed previews that are due, and the retirement (VAE decode) of
every request whose schedule has ended. :meth:`StepEngine.admit` adds requests between two steps:
their prompts are encoded together and each gets its own copy of the noise scheduler and its own
generators, so a request's images depend on nothing but its own fields.

No sockets here: the executor process (:mod:`diffserve.executor.process`) feeds it work and sends
what it returns. It needs torch and a family (:mod:`diffserve.executor.families`), nothing else.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from diffserve.executor.families.base import Conditioning, Family, Prepared, rows
from diffserve.executor.results import CANCELLED, Outcome, Preview, describe, partial_steps
from diffserve.protocol import WorkItem

log = logging.getLogger(__name__)

@dataclass
class Unit:
    """One work item in the running set: ``k`` images of one request, on its own schedule."""

    item: WorkItem
    scheduler: Any
    generators: list
    prepared: Prepared
    cond: Conditioning
    cfg: bool
    partial_at: dict[int, int]
    admitted_at: float
    prompt_tokens: int = 0
    step: int = 0

    @property
    def latents(self):
        return self.prepared.latents

    @property
    def finished(self) -> bool:
        return self.step >= len(self.prepared.timesteps)

    @property
    def size(self) -> int:
        return self.item.size


@dataclass
class StepOutput:
    finished: list[Outcome] = field(default_factory=list)
    previews: list[Preview] = field(default_factory=list)
    images: int = 0  # images the forward carried
    seconds: float = 0.0


class StepEngine:
    def __init__(self, family: Family, count_tokens: Callable[[str], int] = lambda p: 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.family = family
        self.count_tokens = count_tokens
        self.clock = clock
        self.units: list[Unit] = []
        self._cancelled: set[str] = set()

    @property
    def images(self) -> int:
        return sum(u.size for u in self.units)

    def __bool__(self) -> bool:
        return bool(self.units)

    # -- admission -------------------------------------------------------------------------

    def admit(self, items: list[WorkItem], inputs: list[list[Any]]) -> list[Outcome]:
        """Add ``items`` (``inputs[i]``: item i's input frames) to the running set. Returns the
        items that could not be admitted, as failures."""
        torch = self.family.torch
        start = self.clock()
        failed: list[Outcome] = []
        with torch.inference_mode():
            try:
                conds = self._encode(items)
            except Exception as error:  # noqa: BLE001 - reported to each caller
                log.exception("prompt encoding failed")
                return [Outcome(item, None, describe(error), self.clock() - start) for item in items]
            for item, frames, cond in zip(items, inputs, conds):
                try:
                    self.units.append(self._unit(item, frames, cond, start))
                except Exception as error:  # noqa: BLE001 - only this request fails
                    log.warning("could not admit %s: %s", item.request.request_id, error)
                    failed.append(Outcome(item, None, describe(error), self.clock() - start))
        return failed

    def _encode(self, items: list[WorkItem]) -> list[Conditioning]:
        """Every item's text conditioning, in at most two encoder calls: one for the requests with
        a negative prompt, one for the rest (which some families encode differently)."""
        fam = self.family
        cfg = [fam.uses_cfg(item.request.guidance_scale) for item in items]
        with_negative = [i for i, item in enumerate(items) if cfg[i] and item.request.negative_prompt]
        others = [i for i in range(len(items)) if i not in set(with_negative)]
        conds: list[Conditioning | None] = [None] * len(items)
        for group, negatives in ((with_negative, True), (others, False)):
            if not group:
                continue
            encoded = fam.encode([items[i].request.prompt for i in group],
                                 [items[i].request.negative_prompt for i in group] if negatives
                                 else None, any(cfg[i] for i in group))
            for row, i in enumerate(group):
                k = items[i].size
                pick = lambda d: {key: rows(value[row:row + 1], k) for key, value in d.items()}
                conds[i] = Conditioning(pick(encoded.positive),
                                        pick(encoded.negative) if cfg[i] else None)
        return conds

    def _unit(self, item: WorkItem, frames: list[Any], cond: Conditioning, start: float) -> Unit:
        fam, r = self.family, item.request
        torch = fam.torch
        generators = [torch.Generator("cpu").manual_seed(r.seed + i) for i in range(item.start, item.stop)]
        scheduler = fam.new_scheduler()
        image = np.asarray(frames[0]).reshape(r.height, r.width, 3) if frames else None
        mask = np.asarray(frames[1]).reshape(r.height, r.width) if len(frames) > 1 else None
        dtype = next(iter(cond.positive.values())).dtype
        prepared = fam.prepare(r.task, scheduler, r.num_inference_steps, r.strength, r.width,
                               r.height, generators, dtype, image, mask)
        if prepared.cond is not None:
            cond.positive.update(prepared.cond.positive)
            if cond.negative is not None:
                cond.negative.update(prepared.cond.negative)
        return Unit(item, scheduler, generators, prepared, cond, cond.negative is not None,
                    partial_steps(r.partial_images, len(prepared.timesteps)), start,
                    self.count_tokens(r.prompt))

    def cancel(self, request_ids: list[str]) -> None:
        """Drop these requests at the next step."""
        held = {u.item.request.request_id for u in self.units}
        self._cancelled.update(rid for rid in request_ids if rid in held)

    # -- one step --------------------------------------------------------------------------

    def step(self) -> StepOutput:
        out = StepOutput()
        self._drop_cancelled(out)
        if not self.units:
            return out
        start = self.clock()
        with self.family.torch.inference_mode():
            self._denoise(out)
            self._previews(out)
            self._retire(out)
        out.seconds = self.clock() - start
        return out

    def _drop_cancelled(self, out: StepOutput) -> None:
        if not self._cancelled:
            return
        keep = []
        for u in self.units:
            if u.item.request.request_id in self._cancelled:
                out.finished.append(Outcome(u.item, None, CANCELLED, self.clock() - u.admitted_at))
            else:
                keep.append(u)
        self.units, self._cancelled = keep, set()

    def _denoise(self, out: StepOutput) -> None:
        units = self.units
        out.images = sum(u.size for u in units)
        try:
            predictions = self._predict(units)
        except Exception as error:  # noqa: BLE001 - find the request that causes it
            log.warning("batched step failed (%s); retrying each request alone", error)
            predictions = []
            for u in list(units):
                try:
                    predictions.extend(self._predict([u]))
                except Exception as own:  # noqa: BLE001 - only this request fails
                    self.units.remove(u)
                    out.finished.append(Outcome(u.item, None, describe(own),
                                                self.clock() - u.admitted_at))
            units = self.units
        for u, noise in zip(units, predictions):
            self._advance(u, noise)

    def _predict(self, units: list[Unit]) -> list[Any]:
        """One denoiser forward for ``units``; each unit's noise prediction, guidance applied."""
        fam, torch = self.family, self.family.torch
        inputs, timesteps, guidance, conds = [], [], [], []
        for u in units:
            t = u.prepared.timesteps[u.step]
            x = torch.cat([u.latents] * 2) if u.cfg else u.latents
            if not fam.flow_matching:
                x = u.scheduler.scale_model_input(x, t)
            inputs.append(x)
            timesteps.append(t.expand(x.shape[0]) if t.dim() == 0 else t.repeat(x.shape[0]))
            guidance.append(torch.full((x.shape[0],), u.item.request.guidance_scale,
                                       dtype=torch.float32, device=x.device))
            conds.append(u.cond)
        cond = {key: torch.cat([part for c in conds for part in (
            (c.negative[key], c.positive[key]) if c.negative else (c.positive[key],))])
            for key in conds[0].positive}
        r = units[0].item.request  # every unit of a running set has the same size
        output = fam.forward(torch.cat(inputs), torch.cat(timesteps), cond, torch.cat(guidance),
                             r.width, r.height)
        predictions, offset = [], 0
        for u, x in zip(units, inputs):
            part, offset = output[offset:offset + x.shape[0]], offset + x.shape[0]
            if u.cfg:
                uncond, text = part.chunk(2)
                part = uncond + u.item.request.guidance_scale * (text - uncond)
            predictions.append(part)
        return predictions

    def _advance(self, u: Unit, noise) -> None:
        p = u.prepared
        t = p.timesteps[u.step]
        p.latents = u.scheduler.step(noise, t, p.latents, **p.step_kwargs, return_dict=False)[0]
        if p.blend is not None:  # inpainting: outside the mask, the input at this noise level
            b = p.blend
            proper = b["image_latents"]
            if u.step < len(p.timesteps) - 1:
                proper = self.family.renoise(u.scheduler, proper, b["noise"], p.timesteps[u.step + 1])
            p.latents = (1 - b["mask"]) * proper + b["mask"] * p.latents
        u.step += 1

    def _previews(self, out: StepOutput) -> None:
        due = [u for u in self.units if u.step in u.partial_at and not u.finished]
        for units, pixels in self._decode(due):
            offset = 0
            for u in units:
                r, index = u.item.request, u.partial_at[u.step]
                out.previews.extend(Preview(r.request_id, u.item.start + j, index, pixels[offset + j])
                                    for j in range(u.size))
                offset += u.size

    def _decode(self, units: list[Unit]):
        """Pixels of ``units``' latents: one VAE call per task among them (they share a size).
        Yields (units, pixels); raises what decoding raises."""
        tasks: dict[str, list[Unit]] = {}
        for u in units:
            tasks.setdefault(u.item.request.task, []).append(u)
        for task, group in tasks.items():
            r = group[0].item.request
            latents = self.family.torch.cat([u.latents for u in group])
            yield group, self.family.decode(latents, r.width, r.height, task)

    def _retire(self, out: StepOutput) -> None:
        done = [u for u in self.units if u.finished]
        if not done:
            return
        self.units = [u for u in self.units if not u.finished]
        try:
            decoded = list(self._decode(done))
        except Exception as error:  # noqa: BLE001 - these requests fail, the rest go on
            log.exception("decoding failed")
            out.finished.extend(Outcome(u.item, None, describe(error), self.clock() - u.admitted_at)
                                for u in done)
            return
        now = self.clock()
        for units, pixels in decoded:
            offset = 0
            for u in units:
                out.finished.append(Outcome(u.item, pixels[offset:offset + u.size], None,
                                            now - u.admitted_at, u.prompt_tokens))
                offset += u.size
