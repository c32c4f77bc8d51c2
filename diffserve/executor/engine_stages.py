"""The step engine's work beside its step loop (:mod:`diffserve.executor.stages`): admissions
(prompt encoding, a request's first latents: the input images through the VAE) on the encode
stage, decodes (finished images, previews, a rollout's tensors) on the decode stage.

A job reads the units it is given and touches nothing else of the engine; what it makes is taken
back on the loop, between two steps: an admission's units join the running set at the next step
once they are ready (the steps before it go on without them), a decode's outcomes are answered
as soon as they are made. A job's failure fails only its own requests, and a request cancelled
while its job runs is answered cancelled when the job comes back.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from typing import Any

from diffserve.executor import memory
from diffserve.executor.families.base import split_finite
from diffserve.executor.results import Outcome, PartialImage
from diffserve.executor.stages import Job
from diffserve.executor.units import StepOutput, Unit
from diffserve.samples import group_by, input_arrays, isolate
from diffserve.tasks import REFERENCE

log = logging.getLogger(__name__)

ADMIT, FINISH, PREVIEW = "admit", "finish", "preview"


def _rid(unit: Unit) -> str:
    return unit.request.request_id


class StageWork:
    """What :class:`~diffserve.executor.step_engine.StepEngine` runs on its stages."""

    # -- submitting (the loop) -----------------------------------------------------------

    def _submit(self, stage, kind: str, request_ids: set[str], run, **meta) -> None:
        job = Job(request_ids, run, meta={"kind": kind, **meta})
        # Inline, the job is this step's own work: its time is the step's inner time.
        with nullcontext() if stage.threaded else self.timer.span():
            stage.submit(job)

    def _submit_admission(self, pairs: list, start: float, arrived: dict[str, float]) -> None:
        """Prompts encoded together and each item made a unit, on the encode stage. ``pairs``:
        ((item, frames), adapter stack)."""
        self._submit(self.encode_stage, ADMIT,
                     {item.request.request_id for (item, _), _ in pairs},
                     lambda: self._prepare(pairs, start, arrived), pairs=pairs, start=start)

    def _prepare(self, pairs: list, start: float, arrived: dict[str, float]) -> list:
        """(item, its adapter stack, its unit or the error that stopped it), each pair; prompts
        encoded together, where that raises in parts down to single requests."""
        encoded = isolate(pairs, self._encode_pairs, lambda pair: pair[0][0].request.request_id,
                          "prompt encoding", memory.release)
        made = []
        with self._references_together(encoded):
            for ((item, frames), stack), enc in encoded:
                try:
                    if isinstance(enc, Exception):
                        raise enc
                    made.append((item, stack, self.builder.unit(
                        item, frames, enc, start, stack, arrived[item.request.request_id])))
                except Exception as error:  # noqa: BLE001 - only this request fails
                    log.warning("could not admit %s: %s", item.request.request_id, error)
                    made.append((item, stack, error))
        return made

    @contextmanager
    def _references_together(self, encoded: list):
        """A context in which the admitted edits' input images went through the VAE together
        (where that raises, each request encodes its own as it is made, and fails alone)."""
        edits = [(item, frames, enc) for ((item, frames), _), enc in encoded
                 if item.request.task_spec.references and not isinstance(enc, Exception)]
        together = nullcontext()
        if len(edits) > 1:
            try:
                requests = [(input_arrays(item.request, frames)[REFERENCE.name],
                             item.request.width, item.request.height) for item, frames, _ in edits]
                together = self.family.references_together(requests, edits[0][2].positive.dtype)
                together.__enter__()
            except Exception as error:  # noqa: BLE001 - one at a time finds the culprit
                log.warning("input images could not be encoded together (%s: %s); one at a time",
                            type(error).__name__, error)
                memory.release(error)
                together = nullcontext()
        try:
            yield
        finally:
            together.__exit__(None, None, None)

    def _submit_finish(self, units: list[Unit]) -> None:
        """Units whose schedule ended, out of the running set: decoded (and a rollout's tensors
        made) on the decode stage."""
        self._submit(self.decode_stage, FINISH, {_rid(u) for u in units},
                     lambda: self._finish(units), units=units)

    def _finish(self, units: list[Unit]):
        """Their outcomes; a generator of parts (see :meth:`Stage._run`) where the family
        decodes in parts."""
        if self.family.decodes_in_parts:
            return self._finish_in_parts(units)
        return [self._outcome(u, pixels) for u, pixels in
                isolate(units, self._decode, _rid, "decoding", memory.release)]

    def _finish_in_parts(self, units: list[Unit]):
        outcomes = []
        for u in units:  # a video at a time, each in parts
            r = u.request
            try:
                pixels = yield from self.family.decode_parts(u.prepared.latents, r.width, r.height,
                                                             r.task_spec)
            except Exception as error:  # noqa: BLE001 - only this request fails
                pixels = error
            if isinstance(pixels, Exception):  # out of its except block: its frames are gone
                memory.release(pixels)
            outcomes.append(self._outcome(u, pixels))
        return outcomes

    def _outcome(self, u: Unit, pixels) -> Outcome:
        now = self.clock()
        if isinstance(pixels, Exception):
            log.warning("decoding failed for %s: %s: %s", _rid(u), type(pixels).__name__, pixels)
            return Outcome.failed(u.item, pixels, now - u.admitted_at)
        tensors = None
        if u.trajectory is not None:
            r = u.request
            try:
                tensors = u.trajectory.tensors(self.family, u.scheduler, u.prepared.timesteps,
                                               r.width, r.height, pixels, u.prepared.positive,
                                               r.returns)
            except Exception as error:  # noqa: BLE001 - only this request fails
                return Outcome.failed(u.item, error, now - u.admitted_at)
        return Outcome.made(u.item, pixels, now - u.admitted_at, u.prompt_tokens, tensors,
                            u.cached_steps)

    def _submit_previews(self, units: list[Unit]) -> None:
        """Previews due at this step: each unit's latents now (a copy: the unit steps on),
        decoded on the decode stage."""
        due = [(u, u.prepared.latents.clone(), u.partial_at[u.step]) for u in units]
        self._submit(self.decode_stage, PREVIEW, {_rid(u) for u in units},
                     lambda: self._previews(due), units=units)

    def _previews(self, due: list) -> list:
        """(unit, its previews, or the error that failed them)."""
        found = []
        for (u, latents, index), pixels in isolate(
                due, lambda part: self._decode_latents([(u, x) for u, x, _ in part]),
                lambda d: _rid(d[0]), "a preview decode", memory.release):
            found.append((u, pixels if isinstance(pixels, Exception) else [
                PartialImage(_rid(u), u.item.start + j, index, pixels[j])
                for j in range(u.samples)]))
        return found

    # -- decoding (the stages) -----------------------------------------------------------

    def _decode(self, units: list[Unit]) -> list[Any]:
        return self._decode_latents([(u, u.prepared.latents) for u in units])

    def _decode_latents(self, pairs: list) -> list[Any]:
        """Pixels of each (unit, latents): one VAE call per task among them (they share a size).
        A unit with an image that is not finite gets a NonFiniteOutput, which fails it alone."""
        by_unit: dict[int, Any] = {}
        for group in group_by(pairs, lambda pair: pair[0].request.task).values():
            r = group[0][0].request
            latents = self.family.torch.cat([x for _, x in group])
            parts = split_finite(lambda: self.family.decode(latents, r.width, r.height,
                                                            r.task_spec),
                                 [u.samples for u, _ in group])
            by_unit.update(zip((id(u) for u, _ in group), parts))
        return [by_unit[id(u)] for u, _ in pairs]

    # -- taking back (the loop) ----------------------------------------------------------

    def _take_stages(self, out: StepOutput) -> None:
        """What the stages have done since the last step: units that join, outcomes, previews."""
        for job in self.encode_stage.take():
            out.finished += self._admitted(job)
        for job in self.decode_stage.take():
            if job.meta["kind"] == FINISH:
                out.finished += self._finished(job)
            else:
                self._previewed(job, out)

    def _admitted(self, job: Job) -> list[Outcome]:
        if job.meta.get("abandoned"):
            return []
        made = job.result if job.error is None else [
            (item, stack, job.error) for (item, _), stack in job.meta["pairs"]]
        if job.cancelled:  # never run: every request of it was cancelled
            made = [(item, stack, None) for (item, _), stack in job.meta["pairs"]]
        failed = []
        elapsed = self.clock() - job.meta["start"]
        for item, stack, unit in made:
            rid = item.request.request_id
            if rid in self._cancelled_in_stage or unit is None:
                self._cancelled_in_stage.discard(rid)
                self._release(stack)
                failed.append(Outcome.cancelled(item, elapsed))
            elif isinstance(unit, BaseException):
                self._release(stack)
                failed.append(Outcome.failed(item, unit, elapsed))
            else:
                self.units.append(unit)
        return failed

    def _finished(self, job: Job) -> list[Outcome]:
        if job.meta.get("abandoned"):
            return []
        units = job.meta["units"]
        outcomes = job.result if job.error is None else [
            Outcome.failed(u.item, job.error, self.clock() - u.admitted_at) for u in units]
        for i, o in enumerate(outcomes):
            rid = o.item.request.request_id
            if rid in self._cancelled_in_stage:
                self._cancelled_in_stage.discard(rid)
                outcomes[i] = Outcome.cancelled(o.item, o.execution_s)
        return outcomes

    def _previewed(self, job: Job, out: StepOutput) -> None:
        if job.meta.get("abandoned"):
            return
        found = job.result if job.error is None else [(u, job.error) for u in job.meta["units"]]
        for u, previews in found:
            if isinstance(previews, BaseException):
                if u in self.units:  # its final decode would fail as well
                    self._fail(u, out, previews, "a preview decode")
            elif u in self.units or _rid(u) not in self._cancelled_in_stage:
                out.partials.extend(previews)

    def _in_stages(self) -> list:
        """The work items in the stages' jobs not taken back yet."""
        items = []
        for stage in (self.encode_stage, self.decode_stage):
            for job in stage.jobs_held():
                if job.meta["kind"] == ADMIT:
                    items += [item for (item, _), _ in job.meta["pairs"]]
                elif job.meta["kind"] == FINISH:
                    items += [u.item for u in job.meta["units"]]
        return items


    def note_stall(self, seconds: float) -> None:
        """The loop waited ``seconds`` with nothing to step but stage work: the encode stage's
        wait where it holds admissions (nothing can run until they join), else the decode's."""
        stage = self.encode_stage if self.encode_stage.depth else self.decode_stage
        with stage._lock:
            stage.stall_s += seconds

    def _count_stages(self, out: StepOutput) -> None:
        for stage in (self.encode_stage, self.decode_stage):
            out.stage_busy[stage.name], out.stage_stall[stage.name] = stage.take_times()
            out.stage_depth[stage.name] = stage.depth
        cache = self.builder.prompt_cache
        if cache is not None:
            out.prompt_cache = cache.take_counts()
