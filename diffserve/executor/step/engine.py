"""The step engine: running sets of requests that join and leave between denoising steps.

The engine holds one running set per batch key (what must match within one forward: the size):
requests of different sizes run at once, each set advancing in turn. Every step is planned, then
executed, as an LLM engine core schedules and then runs a step:

- **plan** (:mod:`~diffserve.executor.step.planner`, torch-free): which requests leave (their
  callers have gone), which are paused, which of those waiting inside the engine join, and which
  running set advances (a set policy named by configuration, :mod:`diffserve.policies`);
- **execute**: the membership changes (:mod:`~diffserve.executor.step.lifecycle`), one batched
  denoiser forward that carries every sample of the chosen set at its own timestep (with its own
  guidance scale and negative prompt), each request's own scheduler step, streamed previews that
  are due, and the retirement (VAE decode) of every request whose schedule has ended.

:meth:`StepEngine.admit` adds requests between two steps: their prompts are encoded together and
each gets its own copy of the noise scheduler and its own generators
(:mod:`~diffserve.executor.step.admission`), on the encode stage
(:mod:`~diffserve.executor.step.stage_work`), so a request's images depend on nothing but its own
fields. What a scheduler needs (input scaling, its own noise) is asked of the scheduler itself,
never of the family.

Every stage fails only the requests that cause an error: a batched stage that raises (the forward,
a decode) is run again in halves down to single requests (an out-of-memory forward splits until
it fits), and a request's own scheduler step or inpainting blend fails that request alone. The
engine itself never raises out of a step.

No sockets here: the executor process feeds it work and sends what it returns. It needs torch and
a family (:mod:`diffserve.executor.families`), nothing else.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, Callable

from diffserve.executor.control.residuals import narrowed, residuals
from diffserve.executor.families.base import Family
from diffserve.executor.memory import oom
from diffserve.executor.parallel.failures import is_group_failure
from diffserve.executor.results import Outcome, describe
from diffserve.executor.rows import put, selection, take
from diffserve.executor.step.admission import UnitBuilder
from diffserve.executor.step.lifecycle import Members, request_id
from diffserve.executor.step.planner import Planner, StepPlan
from diffserve.executor.step.set_inputs import SetInputs
from diffserve.executor.step.stage_work import StageWork, TakenBack
from diffserve.executor.step.timer import StepTimer
from diffserve.executor.step.units import (StepOutput, StepTime, Unit, Waiting, batch_key_of,
                                           count_tokens)
from diffserve.policies import SetPolicy
from diffserve.policies.base import Member
from diffserve.policies.fair import TimeFair
from diffserve.wire.request import WorkItem
from diffserve.wire.samples import group_by, isolate

log = logging.getLogger(__name__)


class StepEngine:
    def __init__(self, family: Family, count_tokens: Callable[[str], int] = lambda p: 0,
                 clock: Callable[[], float] = time.perf_counter, adapters=None,
                 policy: SetPolicy | None = None, step_cache=None, cache_threshold: float = 0.0,
                 group=None, stages: bool = False, prompt_cache=None,
                 defer_timing: bool = False, text_multiple: int = 1,
                 mixed_sizes: frozenset[str] = frozenset()) -> None:
        """``adapters``: the :class:`~diffserve.executor.lora.store.AdapterStore`, if any.
        ``policy``: which running set a step advances (default: time-fair). ``step_cache``: a
        :class:`~diffserve.executor.accel.step_cache.StepCache` over the family's denoisers, and
        the threshold of requests that name none. ``group``: the parallel group this rank is one
        of (:class:`~diffserve.executor.parallel.topology.Group`), if any. ``stages``: encode and
        decode on threads of their own beside the step loop (else inline, on it);
        ``prompt_cache``: a :class:`~diffserve.executor.step.prompt_cache.PromptCache`, if
        any. ``defer_timing``: on CUDA, a step's time is read a step later (in the next
        output's ``timed``), so that the host never waits for the device between steps (the
        serving loop); else each output carries its own step's time. ``text_multiple``: what
        prompt lengths are padded to (static-shape compile). ``mixed_sizes``: the mode keys
        (tasks) whose requests of different sizes share a running set, where an item's key was
        not computed by the scheduler's queue (the family pads their rows)."""
        self.family, self.group, self.clock = family, group, clock
        self.adapters, self.step_cache = adapters, step_cache
        self._cfg_parallel = group is not None and group.degrees.cfg > 1
        # A collective that failed: the whole group restarts, no retry can help.
        self._group_failure = is_group_failure if group is not None else (lambda error: False)
        self.planner = Planner(policy or TimeFair())
        self._inputs: dict[tuple, SetInputs] = {}  # per running set, while its members stay
        self.members = Members(family, adapters, clock, lambda key: self._inputs.pop(key, None))
        self.mixed_sizes = frozenset(mixed_sizes)
        self.builder = UnitBuilder(family, count_tokens, self.members.rows, step_cache,
                                   cache_threshold, prompt_cache, self.mixed_sizes)
        # A step's time as the device spent it (on CUDA: events, read a step later if deferred).
        self.timer = StepTimer(family.torch, family.device, clock)
        self._keep_laps = 1 if defer_timing else 0
        self._text_multiple = text_multiple
        self._timed: list[StepTime] = []  # steps whose time became known since the last output
        self.stage_work = StageWork(family, self.builder, self.timer, clock, stages)
        if adapters is not None:
            family.row_scope.listen(adapters.rows.narrow)
        if step_cache is not None:
            family.row_scope.listen(step_cache.narrow)
            if adapters is not None:
                step_cache.narrow_rows_with(adapters.rows.narrow)

    # -- what it holds -----------------------------------------------------------------------

    @property
    def units(self) -> list[Unit]:
        return self.members.units

    @property
    def waiting(self) -> list[Waiting]:
        return self.members.waiting

    @property
    def paused(self) -> dict[tuple[str, int], Unit]:
        return self.members.paused

    @property
    def samples(self) -> int:
        return sum(u.samples for u in self.units)

    def running_sets(self) -> dict[tuple, list[Unit]]:
        return group_by(self.units, lambda u: u.batch_key)

    def __bool__(self) -> bool:
        """Whether there is a step to take or stage work to take back (paused items wait for
        their resume)."""
        return self.steppable or self.stage_pending

    @property
    def steppable(self) -> bool:
        return bool(self.units or self.waiting)

    @property
    def stage_pending(self) -> bool:
        return self.stage_work.pending

    @property
    def wakeup(self):
        """Readable when a stage finishes a job (threaded stages), else None."""
        return self.stage_work.wakeup

    def note_stall(self, seconds: float) -> None:
        self.stage_work.note_stall(seconds)

    def cache_bytes(self) -> int:
        """Bytes the step caches of the running and paused requests hold."""
        return sum(u.cache.nbytes for u in self.members.held() if u.cache is not None)

    def close(self) -> None:
        self.stage_work.close()

    # -- between steps (what the scheduler asks) ------------------------------------------

    def admit(self, items: list[WorkItem], inputs: list[list[Any]],
              arrived: dict[str, float] | None = None) -> list[Outcome]:
        """Add ``items`` (``inputs[i]``: item i's input frames) to the running set. Returns the
        items that could not be admitted, as failures. ``arrived``: when requests arrived (a
        request's time counts from its arrival at the scheduler; by default its queued time
        before now)."""
        start = self.clock()
        arrived = {item.request.request_id: start - item.queued_s for item in items} | (arrived or {})
        failed: list[Outcome] = []
        ready = []
        for item, frames in zip(items, inputs):
            if item.resume:
                self.members.resume(item)
                continue
            try:
                stack = self.members.acquire(item)
            except Exception as error:  # noqa: BLE001 - only this request fails
                failed.append(Outcome.failed(item, describe(error), self.clock() - start))
                continue
            if stack is None:
                key = batch_key_of(item, self.mixed_sizes)
                self.members.waiting.append(Waiting(item, frames, key,
                                                    Member(arrived[item.request.request_id])))
            else:
                ready.append(((item, frames), stack))
        if not ready:
            return failed
        # Prompts are encoded together (where that raises, in parts down to single requests,
        # so a request whose prompt or adapters break the encoder fails alone), each item made a
        # unit on the encode stage; inline, they join now.
        self.stage_work.admit(ready, start, arrived)
        if not self.stage_work.encode.threaded:
            failed += self._apply(self.stage_work.take(admissions_only=True), StepOutput())
        return failed

    def cancel(self, request_ids: list[str]) -> None:
        """Drop these requests at the next step (or as their stage's job comes back)."""
        self.members.cancel(request_ids)
        self.stage_work.cancel(request_ids)

    def pause(self, keys: list[tuple[str, int]]) -> None:
        self.members.pause(keys)

    def abandon(self, error: str) -> list[Outcome]:
        """Fail everything held (after an error no request's stage accounts for), releasing
        its adapters; the engine is empty and usable afterwards."""
        outcomes = [Outcome.failed(item, error, 0.0) for item in self.stage_work.held()]
        for stack in self.stage_work.abandon():
            self.members.release(stack)
        return self.members.abandon(error) + outcomes

    # -- one step --------------------------------------------------------------------------

    def plan(self) -> StepPlan:
        running, waiting = self.members.entries()
        return self.planner.plan(running, waiting, self.members.cancelled, self.clock(),
                                 self.members.pausing)

    def step(self, plan: StepPlan | None = None) -> StepOutput:
        """Plan one step (or take ``plan``: a group's other ranks take their leader's), then
        execute it."""
        out = StepOutput()
        out.finished += self._apply(self.stage_work.take(), out)
        plan = plan or self.plan()
        self.members.leave(plan, out)
        self.members.park(plan)
        joining = self.members.joining(plan)
        if joining:
            out.finished += self.admit([w.item for w in joining], [w.frames for w in joining],
                                       {w.item.request.request_id: w.member.arrived_at
                                        for w in joining})
        self._execute(plan, out)
        # Inline, this step's decodes; on threads, what is done by now.
        out.finished += self._apply(self.stage_work.take(), out)
        self.stage_work.count(out)
        cache = self.builder.prompt_cache
        if cache is not None:
            out.prompt_cache = cache.take_counts()
        out.sets = len(self.running_sets())
        out.running_cost = sum(u.cost for u in self.units)
        if self.step_cache is not None:
            out.cache_bytes = self.cache_bytes()
        return out

    def _apply(self, back: TakenBack, out: StepOutput) -> list[Outcome]:
        """What the stages handed back, applied: admitted units join, stacks no unit holds are
        released, previews of units still running (or not cancelled) go out; the answers."""
        self.units.extend(back.joined)
        for stack in back.released:
            self.members.release(stack)
        for u, previews, left in back.previews:
            if isinstance(previews, BaseException):
                if u in self.units:  # its final decode would fail as well
                    self._fail(u, out, previews, "a preview decode")
            elif u in self.units or not left:
                out.partials.extend(previews)
        return back.answered

    def _execute(self, plan: StepPlan, out: StepOutput) -> None:
        """One step of the planned set: the forward, every member's scheduler step, previews,
        retirements."""
        if not self.units:
            return
        units = [u for u in self.units if u.batch_key == plan.advance]
        if not units:
            # The set it planned for was to be opened by a join that did not fit: the set of the
            # request that joined first. No clock decides it, so every rank of a group takes
            # the same one.
            units = [u for u in self.units if u.batch_key == self.units[0].batch_key]
        out.batch_key = units[0].batch_key
        out.samples, out.cost = sum(u.samples for u in units), sum(u.cost for u in units)
        count_tokens(self.family, units, out)
        self.timer.begin(partial(self._timed_step, [u.member for u in units], out.samples,
                                 out.cost, out.batch_key))
        with self.family.torch.inference_mode():
            for unit, noise in self._each(units, self._predict, "the denoiser forward", out):
                self._advance(unit, noise, out)
            out.progress = [(request_id(u), u.step, len(u.prepared.timesteps)) for u in units
                            if u.request.progress and u in self.units]
            due = [u for u in units if u in self.units and u.step in u.partial_at
                   and not u.finished]
            if due:
                self.stage_work.preview(due)
            self._retire(units)
        for unit in units:
            unit.member.stepped(0.0)  # the step counts now; its seconds once read
        # Nothing left to queue: read every lap now rather than at a step that may not come.
        self.timer.end(self._keep_laps if self.units else 0)
        out.timed, self._timed = self._timed, []
        out.seconds = sum(t.seconds for t in out.timed)
        out.host_seconds = sum(t.host_seconds for t in out.timed)
        if self.step_cache is not None:
            out.cache_hits, out.cache_misses = self.step_cache.take_counts()

    def _timed_step(self, members, samples: int, cost: float, batch_key, seconds: float,
                    inner: float) -> None:
        self._timed.append(StepTime(seconds, max(0.0, seconds - inner), samples, cost, batch_key))
        for member in members:
            member.charge(seconds)

    def _each(self, units: list[Unit], run: Callable[[list[Unit]], list], what: str,
              out: StepOutput) -> list[tuple[Unit, Any]]:
        """``run`` over ``units`` (one result each), isolating failures: a unit whose request
        causes an error leaves the running set as failed; the others get their results."""
        done = []
        for unit, result in isolate(units, run, request_id, what, oom.release, self._group_failure):
            if isinstance(result, Exception):
                self._fail(unit, out, result, what)
            else:
                done.append((unit, result))
        return done

    def _fail(self, unit: Unit, out: StepOutput, error: Exception, what: str) -> None:
        log.warning("%s failed for %s: %s: %s", what, request_id(unit), type(error).__name__, error)
        self.members.remove(unit, out, Outcome.failed(unit.item, error,
                                                      self.clock() - unit.admitted_at))

    # -- the forward -----------------------------------------------------------------------

    def _predict(self, units: list[Unit]) -> list[Any]:
        """One denoiser forward for ``units``; each unit's noise prediction, guidance applied."""
        fam = self.family
        inputs = self._inputs.get(units[0].batch_key)
        if inputs is None or not inputs.matches(units):
            inputs = self._inputs[units[0].batch_key] = SetInputs(
                units, fam.torch, fam.control_from_positive, self._text_multiple, fam.row_tokens)
        latents, timesteps = inputs.inputs()
        r = units[0].request  # its size, where every unit of the forward has the same
        uses = inputs.control.active(units) if inputs.control else []
        with (self.timer.span(), self.members.rows(inputs.stacks),
              inputs.cached(self.step_cache, fam, force=bool(uses))):
            # Every control model once over the rows that use it, before the denoiser.
            control = residuals(fam, uses, latents, timesteps, inputs.cond, inputs.guidance,
                                r.width, r.height, inputs.sizes)
            branches = inputs.cfg_branches() if self._cfg_parallel else None
            if branches is None:
                output = self._forward(inputs, latents, timesteps, slice(None), r, control)
            else:  # this rank's branch, then every branch's rows from the others
                mine = branches[self.group.spec.cfg_rank]
                with fam.row_scope.narrow(mine):
                    part = self._forward(inputs, latents, timesteps, mine, r, control)
                gathered = self.group.gather_rows(part, [len(b) for b in branches])
                output = put(gathered.new_empty((inputs.rows, *gathered.shape[1:])),
                             selection(branches[0] + branches[1], gathered.device), gathered)
        return inputs.predictions(fam, output)

    def _forward(self, inputs: SetInputs, latents, timesteps, rows, r, control=None):
        """The family's forward over the set's rows: all of them (``slice(None)``), or a list
        of them (this rank's CFG branch); ``control``: the rows' ControlNet residuals."""
        fam = self.family
        host = inputs.host_timesteps() if fam.splits_by_timestep else None
        cond, guidance = inputs.cond, inputs.guidance
        if not isinstance(rows, slice):
            host = host and [host[i] for i in rows]
            index = selection(rows, latents.device)
            latents, timesteps, guidance = (take(index, t) for t in (latents, timesteps, guidance))
            cond = cond.select(index, rows)
            control = narrowed(control, index)
        extra = {"host_timesteps": host} if host is not None else {}
        if control is not None:
            extra["control"] = control
        if inputs.sizes is not None:  # rows of several sizes, padded to the longest
            extra["sizes"] = inputs.sizes if isinstance(rows, slice) else inputs.sizes.select(rows)
        return fam.forward(latents, timesteps, cond, guidance, r.width, r.height, **extra)

    # -- after the forward -----------------------------------------------------------------

    def _advance(self, u: Unit, noise, out: StepOutput) -> None:
        """The unit's own scheduler step (and inpainting blend); an error fails its request only."""
        p, fam = u.prepared, self.family
        try:
            t = p.timesteps[u.step]
            if u.trajectory is not None:
                latents = u.trajectory.step(u.scheduler, u.step, p.latents, noise)
            else:
                latents = fam.denoise_step(u.scheduler, noise, t, p.latents, p.step_kwargs)
            if p.blend is not None:
                last = u.step == len(p.timesteps) - 1
                latents = fam.blend(u.scheduler, p.blend, latents,
                                    None if last else p.timesteps[u.step + 1])
        except Exception as error:  # noqa: BLE001 - only this request fails
            self._fail(u, out, error, "the scheduler step")
            return
        p.latents = latents
        u.step += 1

    def _retire(self, units: list[Unit]) -> None:
        """Units whose schedule ended leave the running set now; their decode follows on the
        decode stage, and they are answered when it is done."""
        done = [u for u in units if u in self.units and u.finished]
        if not done:
            return
        for u in done:
            # Per image, its steps that reused its step cache (None where no step cache runs).
            u.cached_steps = (None if self.step_cache is None else
                              list(u.cache.cached) if u.cache is not None else [0] * u.samples)
            self.members.drop(u)
        self.stage_work.finish(done)
