"""The step engine: running sets of requests that join and leave between denoising steps.

The engine holds one running set per batch key (what must match within one forward: the size):
requests of different sizes run at once, each set advancing in turn. Every step is planned, then
executed, as an LLM engine core schedules and then runs a step:

- **plan** (:mod:`diffserve.executor.planner`, torch-free): which requests leave (their callers
  have gone), which of those waiting inside the engine join, and which running set advances
  (a set policy named by configuration, :mod:`diffserve.policies`);
- **execute**: the admissions, one batched denoiser forward that carries every sample of the
  chosen set at its own timestep (with its own guidance scale and negative prompt), each
  request's own scheduler step, streamed previews that are due, and the retirement (VAE decode)
  of every request whose schedule has ended.

:meth:`StepEngine.admit` adds requests between two steps: their prompts are encoded together and
each gets its own copy of the noise scheduler and its own generators
(:mod:`diffserve.executor.unit_builder`), so a request's images
depend on nothing but its own fields. What a scheduler needs (input scaling, its own noise) is
asked of the scheduler itself, never of the family.

Every stage fails only the requests that cause an error: a batched stage that raises (the forward,
a decode) is run again in halves down to single requests (an out-of-memory forward splits until
it fits), and a request's own scheduler step or inpainting blend fails that request alone. The
engine itself never raises out of a step.

LoRA adapters never split the running set: each request holds its own stack of adapter versions
from admission to retirement, its prompt is encoded with that stack, and every row of a forward
gets only its own request's adapters at its own scales (:mod:`diffserve.executor.adapters`). A
request whose adapters cannot all be resident yet (every slot is held by running requests) waits
inside the engine and joins at a later step. (The scheduler counts adapter slots when it places
work, so this happens only when several executors' views race, or an adapter was reloaded.)

No sockets here: the executor process (:mod:`diffserve.executor.process`) feeds it work and sends
what it returns. It needs torch and a family (:mod:`diffserve.executor.families`), nothing else.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Any, Callable

from diffserve.executor import memory
from diffserve.executor.adapters import AdapterStore
from diffserve.executor.families.base import Family, park_state, restore_state
from diffserve.executor.families.conditioning import Encoded
from diffserve.executor.moving import moved
from diffserve.executor.planner import Entry, Planner, StepPlan
from diffserve.executor.results import Outcome, describe
from diffserve.executor.row_index import put, selection, take
from diffserve.executor.engine_stages import StageWork
from diffserve.executor.running_batch import Layout
from diffserve.executor.stages import Stage, Wakeup
from diffserve.executor.step_timer import StepTimer
from diffserve.executor.unit_builder import UnitBuilder
from diffserve.executor.units import StepOutput, Unit, Waiting, batch_key_of
from diffserve.policies import SetPolicy
from diffserve.policies.fair import TimeFair
from diffserve.policies.base import Member
from diffserve.protocol import WorkItem
from diffserve.samples import group_by, isolate

log = logging.getLogger(__name__)


def _request_id(unit: Unit) -> str:
    return unit.request.request_id


class StepEngine(StageWork):
    def __init__(self, family: Family, count_tokens: Callable[[str], int] = lambda p: 0,
                 clock: Callable[[], float] = time.perf_counter,
                 adapters: AdapterStore | None = None, policy: SetPolicy | None = None,
                 step_cache=None, cache_threshold: float = 0.0, group=None,
                 stages: bool = False, prompt_cache=None) -> None:
        """``policy``: which running set a step advances (default: time-fair). ``step_cache``: a
        :class:`~diffserve.executor.step_cache.StepCache` over the family's denoisers, and the
        threshold of requests that name none. ``group``: the parallel group this rank is one of
        (:class:`~diffserve.executor.parallel.Group`), if any. ``stages``: encode and decode on
        threads of their own beside the step loop (else inline, on it); ``prompt_cache``: a
        :class:`~diffserve.executor.prompt_cache.PromptCache`, if any."""
        self.family = family
        self.group = group
        self._cfg_parallel = group is not None and group.degrees.cfg > 1
        if group is None:
            self._group_failure = lambda error: False
        else:  # a collective that failed: the whole group restarts, no retry can help
            from diffserve.executor.parallel import is_group_failure

            self._group_failure = is_group_failure
        self.clock = clock
        self.adapters = adapters
        self.planner = Planner(policy or TimeFair())
        self.units: list[Unit] = []
        self.waiting: list[Waiting] = []  # for adapter slots
        self.paused: dict[tuple[str, int], Unit] = {}  # out of the running sets, state kept
        self._cancelled: set[str] = set()
        self._pausing: set[tuple[str, int]] = set()
        self.step_cache = step_cache
        self.builder = UnitBuilder(family, count_tokens, self._rows, step_cache, cache_threshold,
                                   prompt_cache)
        self.wakeup = Wakeup() if stages else None
        self.encode_stage, self.decode_stage = (
            Stage(name, family.torch, family.device, stages,
                  self.wakeup.set if self.wakeup else lambda: None)
            for name in ("encode", "decode"))
        self._cancelled_in_stage: set[str] = set()  # requests in a stage's job that left
        self._layouts: dict[tuple, Layout] = {}  # per running set, while its members stay
        # A step's time as the device spent it (on CUDA: events, and one wait at its end).
        self.timer = StepTimer(family.torch, family.device, clock)
        if adapters is not None:
            family.row_scope.listen(adapters.rows.narrow)
        if step_cache is not None:
            family.row_scope.listen(step_cache.narrow)
            if adapters is not None:
                step_cache.narrow_rows_with(adapters.rows.narrow)

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
        return bool(self.encode_stage.depth or self.decode_stage.depth)

    def close(self) -> None:
        for stage in (self.encode_stage, self.decode_stage):
            stage.close()

    # -- admission -------------------------------------------------------------------------

    def admit(self, items: list[WorkItem], inputs: list[list[Any]],
              arrived: dict[str, float] | None = None) -> list[Outcome]:
        """Add ``items`` (``inputs[i]``: item i's input frames) to the running set. Returns the
        items that could not be admitted, as failures. ``arrived``: when requests that waited
        inside the engine arrived (a request's time counts from its arrival at the scheduler)."""
        start = self.clock()
        arrived = {item.request.request_id: start - item.queued_s for item in items} | (arrived or {})
        failed: list[Outcome] = []
        ready, stacks = [], []
        for item, frames in zip(items, inputs):
            if item.resume:
                self._resume(item)
                continue
            try:
                stack = self._acquire(item)
            except Exception as error:  # noqa: BLE001 - only this request fails
                failed.append(Outcome.failed(item, describe(error), self.clock() - start))
                continue
            if stack is None:
                self.waiting.append(Waiting(item, frames, batch_key_of(item),
                                            Member(arrived[item.request.request_id])))
            else:
                ready.append((item, frames))
                stacks.append(stack)
        if not ready:
            return failed
        # Prompts are encoded together (where that raises, in parts down to single requests,
        # so a request whose prompt or adapters break the encoder fails alone), each item made a
        # unit on the encode stage; inline, they join now.
        self._submit_admission(list(zip(ready, stacks)), start, arrived)
        if not self.encode_stage.threaded:
            for job in self.encode_stage.take():
                failed += self._admitted(job)
        return failed

    def _encode_pairs(self, pairs: list) -> list[Encoded]:
        return self.builder.encode([item for (item, _), _ in pairs], [stack for _, stack in pairs],
                                   [frames for (_, frames), _ in pairs])

    def _acquire(self, item: WorkItem):
        """The item's adapter stack (held from now on), () without adapters, None to wait."""
        loras = item.request.loras
        if not loras:
            return ()
        if self.adapters is None:
            raise ValueError("this server serves no LoRA adapters")
        return self.adapters.acquire(loras)

    def _release(self, stack) -> None:
        if stack:
            self.adapters.release(stack)

    def _rows(self, stacks: list):
        """A context in which row i of every adapted call gets ``stacks[i]``."""
        if self.adapters is None or not any(stacks):
            return nullcontext()
        return self.adapters.rows.rows(stacks)

    def _resume(self, item: WorkItem) -> None:
        """A paused item back into its running set, where it continues from the step it left
        (an item that finished before its pause came is not here: the resume is dropped)."""
        if item.key in self._pausing:  # resumed before the pause took effect: it never stops
            self._pausing.discard(item.key)
            return
        unit = self.paused.pop(item.key, None)
        if unit is not None:
            self._unpark(unit)
            self.units.append(unit)

    def abandon(self, error: str) -> list[Outcome]:
        """Fail everything held (after an error no request's stage accounts for), releasing
        its adapters; the engine is empty and usable afterwards."""
        now = self.clock()
        held = [*self.units, *self.paused.values()]
        outcomes = [Outcome.failed(u.item, error, now - u.admitted_at) for u in held]
        outcomes += [Outcome.failed(w.item, error, 0.0) for w in self.waiting]
        outcomes += [Outcome.failed(item, error, 0.0) for item in self._in_stages()]
        for stage in (self.encode_stage, self.decode_stage):
            for job in stage.jobs_held():
                job.meta["abandoned"] = True
                job.cancelled = True
                if job.meta["kind"] == "admit":
                    for _, stack in job.meta["pairs"]:
                        self._release(stack)
        for unit in held:
            self._release(unit.adapters)
        self.units, self.waiting, self.paused, self._cancelled = [], [], {}, set()
        return outcomes

    def cancel(self, request_ids: list[str]) -> None:
        """Drop these requests at the next step (or as their stage's job comes back)."""
        held = ({_request_id(u) for u in (*self.units, *self.paused.values())}
                | {w.item.request.request_id for w in self.waiting})
        self._cancelled.update(rid for rid in request_ids if rid in held)
        in_stage = {item.request.request_id for item in self._in_stages()}
        self._cancelled_in_stage.update(set(request_ids) & in_stage)
        self.encode_stage.cancel(self._cancelled_in_stage)

    def pause(self, keys: list[tuple[str, int]]) -> None:
        """Take these running items out of the running sets at the next step; their latents,
        schedulers and generators stay with them (off the accelerator) until they resume."""
        running = {u.key for u in self.units}
        self._pausing.update(key for key in keys if key in running)

    # -- one step --------------------------------------------------------------------------

    def step(self, plan: StepPlan | None = None) -> StepOutput:
        """Plan one step (or take ``plan``: a group's other ranks take their leader's), then
        execute it."""
        out = StepOutput()
        self._take_stages(out)
        plan = plan or self.plan()
        self._leave(plan, out)
        self._pause(plan)
        self._join(plan, out)
        self._execute(plan, out)
        self._take_stages(out)  # inline, this step's decodes; on threads, what is done by now
        self._count_stages(out)
        out.sets = len(self.running_sets())
        out.running_cost = sum(u.cost for u in self.units)
        if self.step_cache is not None:
            out.cache_bytes = self.cache_bytes()
        return out

    def cache_bytes(self) -> int:
        """Bytes the step caches of the running and paused requests hold."""
        return sum(u.cache.nbytes for u in (*self.units, *self.paused.values())
                   if u.cache is not None)

    def plan(self) -> StepPlan:
        running = [Entry(_request_id(u), u.batch_key, u.member, start=u.item.start)
                   for u in self.units]
        waiting = [Entry(w.item.request.request_id, w.batch_key, w.member,
                         self._adapters_fit(w.item)) for w in self.waiting]
        return self.planner.plan(running, waiting, self._cancelled, self.clock(), self._pausing)

    def _adapters_fit(self, item: WorkItem) -> bool:
        return self.adapters is None or self.adapters.fits(item.request.loras)

    def _leave(self, plan: StepPlan, out: StepOutput) -> None:
        gone = set(plan.leave) | {key[0] for key in self.paused if key[0] in self._cancelled}
        self._cancelled = set()
        if not gone:
            return
        for key in [key for key in self.paused if key[0] in gone]:
            unit = self.paused.pop(key)
            self.units.append(unit)  # to leave as the running ones do
            self._remove(unit, out, Outcome.cancelled(unit.item, self.clock() - unit.admitted_at))
        for u in [u for u in self.units if _request_id(u) in gone]:
            self._remove(u, out, Outcome.cancelled(u.item, self.clock() - u.admitted_at))
        for w in [w for w in self.waiting if w.item.request.request_id in gone]:
            self.waiting.remove(w)
            out.finished.append(Outcome.cancelled(w.item, 0.0))

    def _pause(self, plan: StepPlan) -> None:
        self._pausing = set()
        if not plan.pause:  # every step: nothing to do unless a pause is due
            return
        pausing = set(plan.pause)
        for unit in [u for u in self.units if u.key in pausing]:
            self.units.remove(unit)
            self._park(unit)  # the accelerator's memory goes to the others
            self.paused[unit.key] = unit
            # Its set's stacked inputs (its conditioning among them) go too: rebuilt when the
            # set next steps, if any of it is left.
            self._layouts.pop(unit.batch_key, None)

    def _park(self, unit: Unit) -> None:
        """The unit's state (latents, conditioning, its scheduler's tensors, its step cache) off
        the accelerator while it is paused. Nothing to do on a CPU."""
        if self._on_cpu:
            return
        unit.prepared = moved(unit.prepared, "cpu")
        unit.parked = park_state(unit.scheduler)
        if unit.cache is not None:
            unit.cache.to("cpu")

    def _unpark(self, unit: Unit) -> None:
        """Back from :meth:`_park`: each of the scheduler's tensors where it was before."""
        if self._on_cpu:
            return
        unit.prepared = moved(unit.prepared, self.family.device)
        restore_state(unit.scheduler, unit.parked)
        if unit.cache is not None:
            unit.cache.to(self.family.device)

    @property
    def _on_cpu(self) -> bool:
        return self.family.torch.device(self.family.device).type == "cpu"

    def _join(self, plan: StepPlan, out: StepOutput) -> None:
        joining = set(plan.join)
        if not joining:
            return
        now = [w for w in self.waiting if w.item.request.request_id in joining]
        self.waiting = [w for w in self.waiting if w.item.request.request_id not in joining]
        out.finished += self.admit([w.item for w in now], [w.frames for w in now],
                                   {w.item.request.request_id: w.member.arrived_at for w in now})

    def _execute(self, plan: StepPlan, out: StepOutput) -> None:
        """One step of the planned set: the forward, every member's scheduler step, previews,
        retirements."""
        if not self.units:
            return
        start = self.clock()
        self.timer.take_inner()  # what admissions' decodes took is not this step's
        units = [u for u in self.units if u.batch_key == plan.advance]
        if not units:  # the set it planned for was to be opened by a join that did not fit
            key = self.planner.choose([Entry(_request_id(u), u.batch_key, u.member)
                                       for u in self.units], start)
            units = [u for u in self.units if u.batch_key == key]
        out.batch_key = units[0].batch_key
        with self.family.torch.inference_mode():
            out.samples, out.cost = sum(u.samples for u in units), sum(u.cost for u in units)
            for unit, noise in self._each(units, self._predict, "the denoiser forward", out):
                self._advance(unit, noise, out)
            out.progress = [(_request_id(u), u.step, len(u.prepared.timesteps)) for u in units
                            if u.request.progress and u in self.units]
            self._partials(units, out)
            self._retire(units, out)
        out.seconds = self.timer.done() - start
        out.host_seconds = max(0.0, out.seconds - self.timer.take_inner())
        if self.step_cache is not None:
            out.cache_hits, out.cache_misses = self.step_cache.take_counts()
        for unit in units:
            unit.member.stepped(out.seconds)

    def _each(self, units: list[Unit], run: Callable[[list[Unit]], list], what: str,
              out: StepOutput) -> list[tuple[Unit, Any]]:
        """``run`` over ``units`` (one result each), isolating failures: a unit whose request
        causes an error leaves the running set as failed; the others get their results."""
        done = []
        for unit, result in isolate(units, run, _request_id, what, memory.release,
                                    self._group_failure):
            if isinstance(result, Exception):
                self._fail(unit, out, result, what)
            else:
                done.append((unit, result))
        return done

    def _fail(self, unit: Unit, out: StepOutput, error: Exception, what: str) -> None:
        log.warning("%s failed for %s: %s: %s", what, _request_id(unit), type(error).__name__, error)
        self._remove(unit, out, Outcome.failed(unit.item, error,
                                               self.clock() - unit.admitted_at))

    def _remove(self, unit: Unit, out: StepOutput, outcome: Outcome) -> None:
        if unit in self.units:
            self._drop(unit)
            out.finished.append(outcome)

    def _drop(self, unit: Unit) -> None:
        """Out of the running set, its adapters released, its step cache gone."""
        self.units.remove(unit)
        self._release(unit.adapters)
        unit.cache = None
        self._layouts.pop(unit.batch_key, None)

    def _predict(self, units: list[Unit]) -> list[Any]:
        """One denoiser forward for ``units``; each unit's noise prediction, guidance applied."""
        fam = self.family
        layout = self._layouts.get(units[0].batch_key)
        if layout is None or not layout.matches(units):
            layout = self._layouts[units[0].batch_key] = Layout(units, fam.torch)
        latents, timesteps = layout.inputs()
        r = units[0].request  # every unit of one forward has the same size
        with self.timer.span(), self._rows(layout.stacks), self._cached(layout):
            branches = layout.cfg_branches() if self._cfg_parallel else None
            if branches is None:
                output = self._forward(layout, latents, timesteps, slice(None), r)
            else:  # this rank's branch, then every branch's rows from the others
                mine = branches[self.group.spec.cfg_rank]
                with fam.row_scope.narrow(mine):
                    part = self._forward(layout, latents, timesteps, mine, r)
                gathered = self.group.gather_rows(part, [len(b) for b in branches])
                output = put(gathered.new_empty((layout.rows, *gathered.shape[1:])),
                             selection(branches[0] + branches[1], gathered.device), gathered)
        return layout.predictions(fam, output)

    def _forward(self, layout: Layout, latents, timesteps, rows, r):
        """The family's forward over the layout's rows: all of them (``slice(None)``), or a
        list of them (this rank's CFG branch)."""
        fam = self.family
        host = layout.host_timesteps() if fam.splits_by_timestep else None
        cond, guidance = layout.cond, layout.guidance
        if not isinstance(rows, slice):
            host = host and [host[i] for i in rows]
            index = selection(rows, latents.device)
            latents, timesteps, guidance = (take(index, t) for t in (latents, timesteps, guidance))
            cond = cond.select(index)
        extra = {"host_timesteps": host} if host is not None else {}
        return fam.forward(latents, timesteps, cond, guidance, r.width, r.height, **extra)

    def _cached(self, layout: Layout):
        """The step cache's context for one forward: each unit's images, threshold and step."""
        if self.step_cache is None:
            return nullcontext()
        r = layout.units[0].request
        return self.step_cache.forward(
            [self.step_cache.entry(u.cache, offset, u.rows, u.samples, u.threshold, u.step,
                                   len(u.prepared.timesteps))
             for u, offset in zip(layout.units, layout.offsets)],
            layout.rows, self.family.cache_tokens(r.width, r.height))

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

    def _partials(self, units: list[Unit], out: StepOutput) -> None:
        due = [u for u in units if u in self.units and u.step in u.partial_at and not u.finished]
        if due:
            self._submit_previews(due)

    def _retire(self, units: list[Unit], out: StepOutput) -> None:
        """Units whose schedule ended leave the running set now; their decode follows on the
        decode stage, and they are answered when it is done."""
        done = [u for u in units if u in self.units and u.finished]
        if not done:
            return
        for u in done:
            u.cached_steps = self._cached_steps(u)
            self._drop(u)
        self._submit_finish(done)

    def _cached_steps(self, u: Unit) -> list[int] | None:
        """Per image, its steps that reused its step cache (None where no step cache runs)."""
        if self.step_cache is None:
            return None
        return list(u.cache.cached) if u.cache is not None else [0] * u.samples
