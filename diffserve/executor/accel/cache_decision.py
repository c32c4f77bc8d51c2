"""The step cache's decisions inside one denoiser call (:mod:`diffserve.executor.accel.step_cache`):
which images hit (their first-block signal changed less than their threshold since their last
computed step), each hit row's output rebuilt from its own cache, and what the images that
computed keep for the next step (committed only when the forward returns)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from diffserve.executor.accel.cache_state import CacheCall, CacheRows
from diffserve.executor.rows import add, put, selection, take


def decide(call: CacheCall, signal, reduce: Callable[[Any], Any] | None) -> None:
    """Which images hit: those whose signal changed less than their threshold since their
    last computed step."""
    compared, sums = [], []
    for e in call.entries:
        c = e.cache
        if (e.threshold <= 0 or e.forced or c is None or c.signal is None or c.owner != call.owner
                or c.signal.shape != e.own(signal).shape):
            continue
        now = e.own(signal)
        compared.append(e)
        sums.append(torch.stack([(now - c.signal).abs().flatten(1).sum(1, dtype=torch.float32),
                                 c.signal.abs().flatten(1).sum(1, dtype=torch.float32)]))
    hit_rows: set[int] = set()
    if compared:
        values = torch.cat(sums, dim=1)
        if reduce is not None:
            values = reduce(values)
        values = values.tolist()  # one read for the whole forward
        at = 0
        for e in compared:
            change, before = values[0][at:at + e.rows], values[1][at:at + e.rows]
            at += e.rows
            for j in range(e.images):
                local = e.local_rows(j)
                base = sum(before[r] for r in local)
                if base > 0 and sum(change[r] for r in local) / base < e.threshold:
                    call.hits.append((e, j))
                    hit_rows.update(e.offset + r for r in local)
    if hit_rows:
        call.miss_list = [r for r in range(call.rows) if r not in hit_rows]
        call.miss = selection(call.miss_list, signal.device)

def rebuilt(call: CacheCall, computed, residual: bool):
    """The tail's hidden output for every row: computed rows as computed, hit rows from
    their caches."""
    def rows_of(e, j, device):  # image j's rows: in the forward, and in its own cache
        local = e.local_rows(j)
        return (selection([e.offset + r for r in local], device),
                take(selection(local, device), e.cache.tail))

    if residual:
        full = call.first_hidden.clone()
        target = full if call.tokens is None else full[:, :call.tokens]
        for e, j in call.hits:
            add(target if e.tokens is None else target[:, :e.tokens], *rows_of(e, j, full.device))
    else:
        sample = call.hits[0][0].cache.tail
        full = sample.new_empty((call.rows, *sample.shape[1:]))
        for e, j in call.hits:
            put(full, *rows_of(e, j, full.device))
    if computed is not None:
        full = put(full, call.miss, computed)
    return full

def keep(call: CacheCall, hidden, residual: bool) -> None:
    """Stage, for the images that computed, their new signal and tail (committed when the
    forward returns); count each hit."""
    tail = hidden - call.first_hidden if residual else hidden
    if residual and call.tokens is not None:
        tail = tail[:, :call.tokens]
    hit = {(id(e), j) for e, j in call.hits}
    for e in call.entries:
        if e.threshold <= 0:
            continue
        computed = [j for j in range(e.images) if (id(e), j) not in hit]
        call.commits.append(partial(_commit, e, call.owner, call.signal, tail, computed))


def _commit(e: CacheRows, owner: int, signal, tail, computed: list[int]) -> None:
    c = e.cache
    for j in range(e.images):
        if j not in computed:
            c.cached[j] += 1
    if not computed:
        return
    signal, tail = e.own(signal), e.own(tail)
    if (len(computed) == e.images or c.signal is None or c.owner != owner
            or c.signal.shape != signal.shape):
        c.signal, c.tail = signal.clone(), tail.clone()
    else:
        local = [r for j in computed for r in e.local_rows(j)]
        c.signal[local] = signal[local]
        c.tail[local] = tail[local]
    c.owner = owner
