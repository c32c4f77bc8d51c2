"""Where waiting work goes: the part of :class:`~diffserve.scheduler.core.SchedulerCore` that
takes work out of the queue and places it on executors.

- **request mode**: a batch goes to an idle executor once the batcher says it is ready (full, or
  its oldest request waited the delay, or the server is draining).
- **step mode**: an executor whose running set has the head's batch key and room takes the head
  and its compatible followers at once ("join"); a busy executor with running-cost room starts a
  new set for another batch key at once ("new_set": it runs from the executor's next step); an
  idle executor starts a set by the same rules as a batch. When the head fits no executor,
  nothing of its batch key passes it, so the head never starves; requests of other batch keys
  may join or open their own sets on busy executors meanwhile, but only within what each
  executor's running budget (and its adapter slots) keeps free beyond the head's next image, so
  they never delay it.
- **a task in request mode on executors that run the step engine** (the start-up check sent it
  there): its batch is one pipeline call, run between two steps; it never takes company once
  sent, and it counts against the executor's running budget like a set until it is answered.
- Among the executors that can take the head, the least loaded (by cost) gets it, one that
  batches it into a running set of its batch key before one that would open a new set.
- Room is counted in images (``max_batch_size`` per forward), in cost (``max_batch_cost`` per
  forward, ``max_running_cost`` per executor across its sets) and, where the server serves LoRA
  adapters, in adapter slots (``max_loras`` distinct adapters held per executor).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from diffserve.wire.protocol import DELAY, DRAIN, EXECUTOR_FREE, FULL, JOIN, NEW_SET, STEP_MODE
from diffserve.wire.request import Work, WorkItem
from diffserve.scheduler.batcher import Slice
from diffserve.scheduler.decisions import Dispatch
from diffserve.scheduler.slots import ExecutorSlot, PaddedRoom, RunningSet, Seat


@dataclass(frozen=True)
class _Placement:
    slot: ExecutorSlot
    room: int         # images the head's group may bring
    room_cost: float  # and their cost
    joins: bool       # into a running set of the head's batch key
    seat: Seat        # the executor, and the adapter slots it may fill


class Placement:
    """Placement and dispatch, over the core's queue (``batcher``) and executors (``slots``)."""

    def _room(self, slot: ExecutorSlot, batch_key: tuple, reserve: float = 0.0,
              reserve_adapters=()) -> _Placement | None:
        """What ``slot`` could take of the first waiting request of ``batch_key``, if anything,
        keeping ``reserve`` of its running budget (and the adapters of ``reserve_adapters``)
        free."""
        if not slot.ready:
            return None
        seat = slot.seat(self.max_loras, reserve_adapters)
        if not slot.sets:  # idle: a new batch or set, by the batching rules
            room, room_cost = self.max_batch_size, min(self.max_batch_cost, self.max_running_cost)
        elif self.mode != STEP_MODE:
            return None  # request mode: one call in flight per executor
        elif self.batcher.is_call(batch_key) and batch_key in slot.sets:
            return None  # that call is under way: the next one waits for it
        else:
            running = slot.sets.get(batch_key, RunningSet(pricing=slot.pricing))
            room = self.max_batch_size - running.samples
            room_cost = min(self.max_batch_cost - running.cost,
                            self.max_running_cost - slot.cost - reserve)
        if self.batcher.mixes_sizes(batch_key):  # a join can widen every row's padding
            running = slot.sets.get(batch_key, RunningSet(pricing=slot.pricing))
            seat.padded = PaddedRoom(running.rows, set(running.by_size),
                                     room_cost + running.cost, slot.pricing)
        if not self.batcher.fits(batch_key, room, room_cost, seat):
            return None
        return _Placement(slot, room, room_cost, batch_key in slot.sets, seat)

    def _place(self, batch_key: tuple, reserve: float = 0.0, reserve_adapters=(),
               busy_only: bool = False) -> _Placement | None:
        """Where the first request of ``batch_key`` goes: the least loaded executor that can
        take it, one that batches it into a running set of its key before one that opens a new
        set."""
        options = [p for slot in self.slots if (slot.sets or not busy_only)
                   and (p := self._room(slot, batch_key, reserve, reserve_adapters)) is not None]
        return min(options, key=lambda p: (p.slot.cost, not p.joins), default=None)

    def time_until_dispatch(self, now: float) -> float | None:
        """Seconds until :meth:`dispatch` has something to send; None if only an event can change
        that (nothing waiting, or no executor that can take the head)."""
        head = self.batcher.head()
        if head is None or self.held:
            return None
        placed = self._place(head[0])
        if placed is None:
            return None
        if placed.slot.sets or self.draining:
            return 0.0
        return self.batcher.time_until_ready(now, placed.room, placed.room_cost)

    def dispatch(self, now: float) -> list[Dispatch]:
        """Everything that can leave the queue now (nothing while the queue is held)."""
        sent = []
        while not self.held and (head := self.batcher.head()) is not None:
            batch_key, enqueued_at = head
            placed = self._place(batch_key)
            if placed is None and self.mode == STEP_MODE and self.policy_uses_priority:
                placed = self._preempt_for(batch_key)
            if placed is None:
                self._head_waits()
                if self.mode == STEP_MODE:
                    sent += self._beside_head(batch_key, now)
                break
            slot = placed.slot
            if slot.sets:  # a busy executor takes it at its next step, into a set of its own size
                slices = self.batcher.take(batch_key, placed.room, placed.room_cost, placed.seat)
                reason = JOIN if placed.joins else NEW_SET
            else:
                wait = self.batcher.time_until_ready(now, placed.room, placed.room_cost)
                if wait > 0 and not self.draining:
                    break
                reason = (FULL if self.batcher.is_full(placed.room, placed.room_cost) else
                          DRAIN if wait > 0 else EXECUTOR_FREE
                          if slot.free_since > enqueued_at + self.max_delay_s else DELAY)
                slices = self.batcher.next_batch(now, True, placed.room, placed.room_cost,
                                                 placed.seat)
            sent.append(self._assign(slot, slices, reason, now))
        return sent

    def _beside_head(self, head: tuple, now: float) -> list[Dispatch]:
        """Step mode, while the head waits for room in its own running set: the first requests
        of other batch keys join (or open) their sets on busy executors, as long as each keeps
        room in its running budget for the head's next image, and slots for its adapters.
        Nothing they take is room the head's set could use, so the head is admitted exactly
        when it would have been had nothing passed it, and the other sets do not drain
        meanwhile."""
        reserve = self.batcher.head_image_cost()
        reserve_adapters = self.batcher.head_request().loras
        sent = []
        for batch_key in self.batcher.batch_keys():
            if batch_key == head:
                continue
            while (placed := self._place(batch_key, reserve, reserve_adapters,
                                         busy_only=True)) is not None:
                slices = self.batcher.take_group(batch_key, placed.room, placed.room_cost,
                                                 placed.seat)
                if not slices:
                    break
                sent.append(self._assign(placed.slot, slices, JOIN if placed.joins else NEW_SET,
                                         now))
        return sent

    def _head_waits(self) -> None:
        """Count a head that no executor has room for while some could serve it (once each)."""
        head = self.batcher.head_id()
        if (self.mode == STEP_MODE and head != self._waiting_head and self.any_ready
                and all(slot.sets for slot in self.slots if slot.ready)):
            self._waiting_head = head
            self.waits_for_room += 1

    def _assign(self, slot: ExecutorSlot, slices: list[Slice], reason: str, now: float) -> Dispatch:
        items, frames, queue_times, classes = [], [], [], []
        for sl in slices:
            tracked = self.requests[sl.request.request_id]
            if tracked.first_dispatch_at is None:
                tracked.first_dispatch_at = now
                queue_times.append(now - tracked.enqueued_at)
                classes.append(sl.request.priority)
            if sl.resume:  # its state is there: it goes back into its running set
                item, _ = slot.unpause((sl.request.request_id, sl.start))
                item = dataclasses.replace(item, resume=True)
            else:
                item = WorkItem(sl.request, sl.start, sl.stop, now - tracked.enqueued_at,
                                sl.batch_key)
                frames.extend(tracked.frames)
            items.append(item)
            slot.put(item, sl.batch_key)
        return Dispatch(slot.index, Work(next(self._work_ids), items), frames, reason, queue_times,
                        classes)

    # -- preemption (step mode, priority classes) -------------------------------------------

    def _preempt_for(self, batch_key: tuple) -> _Placement | None:
        """Room for the head by pausing running items of worse priority classes, the worst and
        then the youngest first, as few as will do, on the executor where the fewest will; the
        pauses are sent before the head's work (:meth:`take_pauses`). None where pausing every
        worse item on an executor would not make room."""
        head = self.batcher.head_request()
        best = None
        for slot in self.slots:
            if not slot.ready:
                continue
            victims = sorted((key for key, (item, _) in slot.items.items()
                              if item.request.priority > head.priority
                              and self.batcher.mode_of(item.request.mode_key) == STEP_MODE),
                             key=lambda key: (-slot.items[key][0].request.priority,
                                              -self.requests[key[0]].enqueued_at))
            for count in range(1, len(victims) + 1):
                if self._room(slot.without(set(victims[:count])), batch_key) is not None:
                    if best is None or count < len(best[1]):
                        best = (slot, victims[:count])
                    break
        if best is None:
            return None
        slot, keys = best
        for key in keys:
            item = slot.pause(key)
            tracked = self.requests[key[0]]
            self.batcher.add_paused(item.request, item.start, item.stop,
                                    slot.paused[key][1], tracked.enqueued_at, slot.index)
        self._pauses.append((slot.index, keys))
        self.preemptions += len(keys)
        return self._room(slot, batch_key)

    def take_pauses(self) -> list[tuple[int, list[tuple[str, int]]]]:
        """Pauses decided since the last call: (executor, item keys), to send before any work."""
        pauses, self._pauses = self._pauses, []
        return pauses
