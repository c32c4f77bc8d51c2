"""The step engine's work beside its step loop (:mod:`diffserve.executor.step.stages`): admissions
(prompt encoding, a request's first latents: the input images through the VAE) on the encode
stage, decodes (finished images, previews, a rollout's tensors) on the decode stage.

:class:`StageWork` is the engine's part that owns both stages. A job reads the units it is given
and touches nothing else of the engine; what it makes is handed back by :meth:`StageWork.take`
on the loop, between two steps, as a :class:`TakenBack` the engine applies: an admission's units
join the running set at the next step once they are ready (the steps before it go on without
them), a decode's outcomes are answered as soon as they are made. A job's failure fails only its
own requests, and a request cancelled while its job runs is answered cancelled when the job
comes back.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

from diffserve.executor.families.outputs import Sounded, split_finite
from diffserve.executor.memory import oom
from diffserve.executor.results import Outcome, PartialImage
from diffserve.executor.step.stages import StageJob, Stage, Wakeup
from diffserve.executor.step.units import Unit
from diffserve.wire.samples import group_by, input_arrays, isolate
from diffserve.wire.tasks import REFERENCE

log = logging.getLogger(__name__)

ADMIT, FINISH, PREVIEW = "admit", "finish", "preview"


def _rid(unit: Unit) -> str:
    return unit.request.request_id


@dataclass
class TakenBack:
    """What the stages finished since the last :meth:`StageWork.take`."""

    joined: list[Unit] = field(default_factory=list)  # admitted units, to join the running set
    answered: list[Outcome] = field(default_factory=list)  # finished, failed or cancelled items
    released: list[tuple] = field(default_factory=list)  # adapter stacks no unit holds now
    # (unit, its previews or the error that failed them, whether it left while they were made)
    previews: list[tuple[Unit, Any, bool]] = field(default_factory=list)


class StageWork:
    """The encode and decode stages of one step engine, and the jobs it gives them. ``builder``:
    the engine's :class:`~diffserve.executor.step.admission.UnitBuilder`; ``timer``: its step
    timer (an inline job is the step's own work); ``threaded``: stages on threads of their own,
    else inline on the loop."""

    def __init__(self, family, builder, timer, clock: Callable[[], float], threaded: bool) -> None:
        self.family, self.builder, self.timer, self.clock = family, builder, timer, clock
        self.wakeup = Wakeup() if threaded else None
        self.encode, self.decode = (
            Stage(name, family.torch, family.device, threaded,
                  self.wakeup.set if self.wakeup else lambda: None)
            for name in ("encode", "decode"))
        self._lock = threading.Lock()
        self._left: set[str] = set()  # requests in a stage's job that left meanwhile

    @property
    def stages(self) -> tuple[Stage, Stage]:
        return self.encode, self.decode

    @property
    def pending(self) -> bool:
        """Whether a stage holds work not taken back yet."""
        return bool(self.encode.depth or self.decode.depth)

    def close(self) -> None:
        for stage in self.stages:
            stage.close()

    # -- submitting (the loop) -----------------------------------------------------------

    def _submit(self, stage: Stage, kind: str, request_ids: set[str], run, **meta) -> None:
        job = StageJob(request_ids, run, meta={"kind": kind, **meta})
        # Inline, the job is this step's own work: its time is the step's inner time.
        with nullcontext() if stage.threaded else self.timer.span():
            stage.submit(job)

    def admit(self, pairs: list, start: float, arrived: dict[str, float]) -> None:
        """Prompts encoded together and each item made a unit, on the encode stage. ``pairs``:
        ((item, frames), adapter stack)."""
        self._submit(self.encode, ADMIT, {item.request.request_id for (item, _), _ in pairs},
                     lambda: self._prepare(pairs, start, arrived), pairs=pairs, start=start)

    def finish(self, units: list[Unit]) -> None:
        """Units whose schedule ended, out of the running set: decoded (and a rollout's tensors
        made) on the decode stage."""
        self._submit(self.decode, FINISH, {_rid(u) for u in units}, lambda: self._finish(units),
                     units=units)

    def preview(self, units: list[Unit]) -> None:
        """Previews due at this step: each unit's latents now (a copy: the unit steps on),
        decoded on the decode stage."""
        due = [(u, u.prepared.latents.clone(), u.partial_at[u.step]) for u in units]
        self._submit(self.decode, PREVIEW, {_rid(u) for u in units},
                     lambda: self._previews(due), units=units)

    # -- the jobs (on the stages) ----------------------------------------------------------

    def _prepare(self, pairs: list, start: float, arrived: dict[str, float]) -> list:
        """(item, its adapter stack, its unit or the error that stopped it), each pair; prompts
        encoded together, where that raises in parts down to single requests."""
        encoded = isolate(pairs, self._encode, lambda pair: pair[0][0].request.request_id,
                          "prompt encoding", oom.release)
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

    def _encode(self, pairs: list) -> list:
        return self.builder.encode([item for (item, _), _ in pairs], [stack for _, stack in pairs],
                                   [frames for (_, frames), _ in pairs])

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
                oom.release(error)
                together = nullcontext()
        try:
            yield
        finally:
            together.__exit__(None, None, None)

    def _finish(self, units: list[Unit]):
        """Their outcomes; a generator of parts (see :meth:`Stage._run`) where the family
        decodes in parts."""
        if self.family.decodes_in_parts:
            return self._finish_in_parts(units)
        return [self._outcome(u, pixels) for u, pixels in
                isolate(units, self._decode, _rid, "decoding", oom.release)]

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
                oom.release(pixels)
            outcomes.append(self._outcome(u, pixels))
        return outcomes

    def _outcome(self, u: Unit, pixels) -> Outcome:
        now = self.clock()
        if isinstance(pixels, Exception):
            log.warning("decoding failed for %s: %s: %s", _rid(u), type(pixels).__name__, pixels)
            return Outcome.failed(u.item, pixels, now - u.admitted_at)
        audio, rate = None, 0
        if isinstance(pixels, Sounded):  # a video with its sound track
            pixels, audio, rate = pixels.pixels, pixels.audio, pixels.sample_rate
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
                            u.cached_steps, audio, rate)

    def _previews(self, due: list) -> list:
        """(unit, its previews, or the error that failed them)."""
        found = []
        for (u, latents, index), pixels in isolate(
                due, lambda part: self._decode_latents([(u, x) for u, x, _ in part]),
                lambda d: _rid(d[0]), "a preview decode", oom.release):
            found.append((u, pixels if isinstance(pixels, Exception) else [
                PartialImage(_rid(u), u.item.start + j, index, pixels[j])
                for j in range(u.samples)]))
        return found

    def _decode(self, units: list[Unit]) -> list[Any]:
        return self._decode_latents([(u, u.prepared.latents) for u in units])

    def _decode_latents(self, pairs: list) -> list[Any]:
        """Pixels of each (unit, latents): one VAE call per task and size among them (a set
        that mixes sizes finishes several at once). A unit with an image that is not finite
        gets a NonFiniteOutput, which fails it alone."""
        by_unit: dict[int, Any] = {}
        for group in group_by(pairs, lambda pair: (pair[0].request.task, pair[0].request.width,
                                                   pair[0].request.height,
                                                   pair[0].request.num_frames)).values():
            r = group[0][0].request
            latents = self.family.torch.cat([x for _, x in group])
            parts = split_finite(lambda: self.family.decode(latents, r.width, r.height,
                                                            r.task_spec),
                                 [u.samples for u, _ in group])
            by_unit.update(zip((id(u) for u, _ in group), parts))
        return [by_unit[id(u)] for u, _ in pairs]

    # -- taking back (the loop) ----------------------------------------------------------

    def take(self, admissions_only: bool = False) -> TakenBack:
        """What the stages have done since the last call (``admissions_only``: the encode
        stage's alone)."""
        back = TakenBack()
        for job in self.encode.take():
            self._admitted(job, back)
        if admissions_only:
            return back
        for job in self.decode.take():
            if job.meta.get("abandoned"):
                continue
            if job.meta["kind"] == FINISH:
                self._finished(job, back)
            else:
                found = (job.result if job.error is None
                         else [(u, job.error) for u in job.meta["units"]])
                with self._lock:
                    back.previews += [(u, p, _rid(u) in self._left) for u, p in found]
        return back

    def _admitted(self, job: StageJob, back: TakenBack) -> None:
        if job.meta.get("abandoned"):
            return
        made = job.result if job.error is None else [
            (item, stack, job.error) for (item, _), stack in job.meta["pairs"]]
        if job.cancelled:  # never run: every request of it was cancelled
            made = [(item, stack, None) for (item, _), stack in job.meta["pairs"]]
        elapsed = self.clock() - job.meta["start"]
        for item, stack, unit in made:
            rid = item.request.request_id
            with self._lock:
                left = rid in self._left
                self._left.discard(rid)
            if left or unit is None:
                back.released.append(stack)
                back.answered.append(Outcome.cancelled(item, elapsed))
            elif isinstance(unit, BaseException):
                back.released.append(stack)
                back.answered.append(Outcome.failed(item, unit, elapsed))
            else:
                back.joined.append(unit)

    def _finished(self, job: StageJob, back: TakenBack) -> None:
        units = job.meta["units"]
        outcomes = job.result if job.error is None else [
            Outcome.failed(u.item, job.error, self.clock() - u.admitted_at) for u in units]
        for o in outcomes:
            rid = o.item.request.request_id
            with self._lock:
                left = rid in self._left
                self._left.discard(rid)
            back.answered.append(Outcome.cancelled(o.item, o.execution_s) if left else o)

    # -- requests that leave, and the whole of it --------------------------------------------

    def held(self) -> list:
        """The work items in the stages' jobs not taken back yet."""
        items = []
        for stage in self.stages:
            for job in stage.jobs_held():
                if job.meta["kind"] == ADMIT:
                    items += [item for (item, _), _ in job.meta["pairs"]]
                elif job.meta["kind"] == FINISH:
                    items += [u.item for u in job.meta["units"]]
        return items

    def cancel(self, request_ids: list[str]) -> None:
        """These requests left: their jobs not started never run, and what comes back of the
        others is answered cancelled."""
        held = {item.request.request_id for item in self.held()}
        with self._lock:
            self._left.update(set(request_ids) & held)
            left = set(self._left)
        self.encode.cancel(left)

    def abandon(self) -> list[tuple]:
        """Every job held is dropped (its results never taken); the adapter stacks its
        admissions held, to release."""
        stacks = []
        for stage in self.stages:
            for job in stage.jobs_held():
                job.meta["abandoned"] = True
                job.cancelled = True
                if job.meta["kind"] == ADMIT:
                    stacks += [stack for _, stack in job.meta["pairs"]]
        return stacks

    # -- what the stages took ------------------------------------------------------------

    def note_stall(self, seconds: float) -> None:
        """The loop waited ``seconds`` with nothing to step but stage work: the encode stage's
        wait where it holds admissions (nothing can run until they join), else the decode's."""
        (self.encode if self.encode.depth else self.decode).add_stall(seconds)

    def count(self, out) -> None:
        """The stages' busy and stall seconds since the last step, and their depths, into
        ``out`` (a :class:`~diffserve.executor.step.units.StepOutput`)."""
        for stage in self.stages:
            out.stage_busy[stage.name], out.stage_stall[stage.name] = stage.take_times()
            out.stage_depth[stage.name] = stage.depth
