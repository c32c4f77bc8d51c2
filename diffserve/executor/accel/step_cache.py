"""Per-image step caching inside a running set (``--step-cache first-block``).

First-Block Cache (ParaAttention's, as diffusers ships it) decides for a whole batch: the first
block runs, and when its residual changed little since the last step, the batch reuses what the
remaining blocks added then. Here the decision is each image's own, inside one forward that
carries every running request at its own step:

- **Every row runs the first block.** For each image, the relative change of its rows' first-block
  signal since the last step the image computed, ``sum|s - s_prev| / sum|s_prev|`` over its rows
  (its classifier-free-guidance rows decide together), is compared with the request's own
  ``cache_threshold``: below it, the image **hits** and reuses its cache; else it **misses** and
  computes. A threshold of 0 never reuses. The first and the last step of a request always
  compute (the first has nothing to compare with; the last makes the final image).
- **Rows that hit leave the forward of the remaining blocks**: those run on the rows that miss
  only (their batch-wise arguments are cut to those rows), and the hit rows' output is rebuilt
  from the cache. The saving is compute, not a mask.
- **Transformers** (Flux, SD3, Qwen-Image, Z-Image, PixArt-Sigma, Sana, Wan): the signal is the
  first block's residual on the image tokens, ``first(h) - h``; an image's cache is what the
  remaining blocks added to the first block's output at its last computed step, and a hit's
  output is the first block's output now plus that. The text stream the last block also returns
  is not read after the blocks by any of these models; a hit row carries the first block's.
  Z-Image's main stack runs image and caption tokens as one sequence whose caption part is
  padded to the longest prompt of the forward: the signal and the cache cover its image tokens
  only, so that no batch-mate's prompt length enters an image's decision.
- **UNets** (SD 1.x/2.x, SDXL): the first down block plays the first block's part: the signal is
  its output (the features it passes down). What a hit reuses is the output of the second-to-last
  up block at the image's last computed step: everything between the first down block and the
  last up block (the deeper down blocks, the mid block, every up block but the last) is skipped,
  and the last up block runs on every row with the first down block's fresh skip connections
  (DeepCache's split at its shallowest branch).
- **Independence**: a decision reads only its own image's rows and its request's threshold, and a
  hit's output only its own cache; rows that miss compute as in any forward. So an image is the
  same alone and among batch-mates with other thresholds (to float rounding, which can tip an
  image whose change lies within ~1e-6 of its threshold).
- Each work item holds its images' caches (:class:`UnitCache`): they are dropped when it leaves
  the running set, moved off the accelerator with it when it is paused, and their bytes are
  reported (``diffserve_step_cache_bytes``). A cache is only used by the denoiser that made it
  (Wan 2.2 switches experts mid-request: the first step after the switch computes).

The engine opens :meth:`StepCache.forward` around each denoiser forward with one
:class:`~diffserve.executor.accel.cache_state.CacheRows` per work item; the blocks' wrappers do the
rest (their decisions: :mod:`~diffserve.executor.accel.cache_decision`). A forward that raises
changes no cache.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any, Callable, Iterator, Sequence

from diffserve.config.flags import ConfigError
from diffserve.executor.accel.cache_decision import decide, keep, rebuilt
from diffserve.executor.accel.cache_state import CacheCall, CacheRows, UnitCache, cache_rows
from diffserve.executor.families.blocks import (
    ENCODER,
    HIDDEN,
    BlockKind,
    is_unet,
    transformer_blocks,
)
from diffserve.executor.accel.wrapping import argument, map_rows, wrap_forward
from diffserve.executor.families.known import block_tables
from diffserve.executor.rows import put, take

OFF, FIRST_BLOCK = "off", "first-block"
MODES = (OFF, FIRST_BLOCK)


class UnsupportedCache(ConfigError):
    """A denoiser the step cache does not know how to split."""


class StepCache:
    """First-Block Cache per image over ``denoisers`` (a family's; Wan 2.2 has two)."""

    def __init__(self, denoisers: Sequence[Any], reduce: Callable[[Any], Any] | None = None) -> None:
        """``reduce``: sums a decision's signal over a parallel group's ranks (each holds a share
        of the tokens), so that every rank decides alike; None on one device."""
        self._reduce = reduce
        self._call: CacheCall | None = None
        self._wrapped = []
        self._narrowers: list[Callable[[list[int]], Any]] = []
        self.hits = self.misses = 0  # rows, since the last take_counts()
        for denoiser in denoisers:
            if is_unet(denoiser):
                self._install_unet(denoiser)
            else:
                self._install_transformer(denoiser)

    @staticmethod
    def unit(images: int) -> UnitCache:
        """A new work item's (empty) cache."""
        return UnitCache(images)

    rows = staticmethod(cache_rows)

    def close(self) -> None:
        for wrapped in reversed(self._wrapped):
            wrapped.restore()
        self._wrapped = []

    def narrow_rows_with(self, narrow: Callable[[list[int]], Any]) -> None:
        """``narrow(rows)``: a context in which other per-row machinery (LoRA rows) sees only
        ``rows`` of the call: entered around every block that runs on the rows that miss."""
        self._narrowers.append(narrow)

    # -- per forward ----------------------------------------------------------------------------

    @contextmanager
    def forward(self, entries: list[CacheRows], rows: int, tokens: int | None = None) -> Iterator[None]:
        """Around one denoiser forward of ``rows`` rows. ``tokens``: the leading image tokens the
        signal and the cache cover (None: all of the hidden states)."""
        call = CacheCall(entries, rows, tokens)
        outer, self._call = self._call, call
        try:
            yield
        finally:
            self._call = outer
        # Reached only when the forward returned: a failed forward changes no cache.
        for commit in call.commits:
            commit()
        hit = call.hit_rows() + sum(part.hit_rows() for part in call.parts)
        self.hits += hit
        self.misses += rows - hit

    @contextmanager
    def narrow(self, index: Sequence[int]) -> Iterator[None]:
        """The next denoiser call carries only rows ``index`` of the forward (a family that
        splits a forward between denoisers); each entry lies wholly inside or outside it."""
        call = self._call
        if call is None:
            yield
            return
        index = list(index)
        position = {row: i for i, row in enumerate(index)}
        entries = [CacheRows(e.cache, position[e.offset], e.rows, e.images, e.threshold, e.forced,
                             e.tokens) for e in call.entries if e.offset in position]
        part = CacheCall(entries, len(index), call.tokens)
        self._call = part
        try:
            yield
        finally:
            self._call = call
        call.commits += part.commits
        call.parts.append(part)

    def take_counts(self) -> tuple[int, int]:
        """Rows that hit and rows that missed since the last call."""
        counts, self.hits, self.misses = (self.hits, self.misses), 0, 0
        return counts

    # -- installing -----------------------------------------------------------------------------

    def _install_transformer(self, denoiser) -> None:
        try:
            blocks = transformer_blocks(denoiser, block_tables())
        except ValueError as error:
            raise UnsupportedCache(f"--step-cache: {error}") from None
        if len(blocks) < 2:
            raise UnsupportedCache(f"--step-cache: {type(denoiser).__name__} has one block; "
                                   "there is nothing after the first to skip")
        if getattr(getattr(denoiser, "config", None), "zero_cond_t", False):
            raise UnsupportedCache("--step-cache: this Qwen-Image variant (zero_cond_t) doubles "
                                   "its timestep rows, which the cache does not split")
        owner = id(denoiser)
        (first, kind), *middle, (tail, tail_kind) = blocks
        self._wrap(first, partial(self._first, owner, kind, first, True))
        for block, block_kind in middle:
            self._wrap(block, partial(self._middle, block_kind, block, _passthrough))
        self._wrap(tail, partial(self._tail, tail_kind, tail, True))

    def _install_unet(self, unet) -> None:
        if len(unet.down_blocks) < 2 or len(unet.up_blocks) < 2:
            raise UnsupportedCache("--step-cache: a UNet needs two levels or more")
        owner, kind = id(unet), BlockKind(shared=frozenset({"cross_attention_kwargs",
                                                            "upsample_size"}))
        first, *down = unet.down_blocks
        *up, tail, _last = unet.up_blocks  # the last up block runs on every row
        self._wrap(first, partial(self._first, owner, kind, first, False))
        for block in down:
            outputs = len(block.resnets) + (1 if getattr(block, "downsamplers", None) else 0)
            self._wrap(block, partial(self._middle, kind, block, _skipped_down(outputs)))
        for block in ([unet.mid_block] if unet.mid_block is not None else []) + up:
            self._wrap(block, partial(self._middle, kind, block, _skipped))
        self._wrap(tail, partial(self._tail, kind, tail, False))

    def _wrap(self, block, around) -> None:
        self._wrapped.append(wrap_forward(block, around))

    # -- the blocks -----------------------------------------------------------------------------

    def _first(self, owner: int, kind: BlockKind, block, residual: bool, original, args, kwargs):
        out = original(*args, **kwargs)
        call = self._call
        if call is None or not call.tracked:
            return out
        hidden = kind.part(out, HIDDEN) if residual else out[0]
        signal = hidden - argument(block, args, kwargs, kind.hidden) if residual else hidden
        if call.tokens is not None:
            signal = signal[:, :call.tokens]
        call.owner, call.signal = owner, signal
        call.first_hidden = hidden
        call.first_encoder = kind.part(out, ENCODER) if residual else None
        decide(call, signal, self._reduce)
        if not call.hits:
            return out
        select = partial(take, call.miss)
        if residual:  # both streams go on with the rows that miss
            return kind.with_parts(out, {p: None if v is None else select(v) for p, v in
                                         ((p, kind.part(out, p)) for p in kind.returns)})
        return (select(out[0]), *out[1:])  # a UNet's skip connections stay whole

    def _middle(self, kind: BlockKind, block, skipped, original, args, kwargs):
        call = self._call
        if call is None or not call.hits:
            return original(*args, **kwargs)
        if not call.miss_list:
            return skipped(block, kind, args, kwargs)
        return self._on_misses(call, kind, block, original, args, kwargs)

    def _tail(self, kind: BlockKind, block, residual: bool, original, args, kwargs):
        call = self._call
        if call is None or not call.tracked:
            return original(*args, **kwargs)
        if not call.hits:
            out = original(*args, **kwargs)
            keep(call, kind.part(out, HIDDEN) if residual else out, residual)
            return out
        computed = (self._on_misses(call, kind, block, original, args, kwargs)
                    if call.miss_list else None)
        hidden = rebuilt(call, None if computed is None else
                               kind.part(computed, HIDDEN) if residual else computed, residual)
        keep(call, hidden, residual)
        if not residual:
            return hidden
        parts = {HIDDEN: hidden}
        if ENCODER in kind.returns:
            parts[ENCODER] = self._encoder(call, block, None if computed is None else
                                           kind.part(computed, ENCODER))
        return kind.with_parts((None,) * len(kind.returns), parts)

    @staticmethod
    def _encoder(call: CacheCall, block, computed):
        """The tail's text stream for every row (not read after the blocks; kept whole so the
        model's code sees what it expects): computed rows as computed, hit rows the first
        block's."""
        if getattr(block, "context_pre_only", False):  # SD3's last block returns none
            return None
        if computed is None:
            return call.first_encoder
        return put(call.first_encoder.clone(), call.miss, computed)

    def _on_misses(self, call: CacheCall, kind: BlockKind, block, original, args, kwargs):
        """``block`` on the rows that miss: its batch-wise arguments cut to them (the hidden
        states that came from the block before already are)."""
        args, kwargs = map_rows(block, args, kwargs, call.rows, kind.shared,
                                partial(take, call.miss))
        if not self._narrowers:
            return original(*args, **kwargs)
        with _entered([narrow(call.miss_list) for narrow in self._narrowers]):
            return original(*args, **kwargs)

def _passthrough(block, kind: BlockKind, args, kwargs):
    """A transformer block every row skips: its inputs (no rows) go on to the next one."""
    parts = {HIDDEN: argument(block, args, kwargs, kind.hidden)}
    if kind.encoder:
        parts[ENCODER] = argument(block, args, kwargs, kind.encoder)
    return kind.with_parts((None,) * len(kind.returns), parts)


def _skipped(block, kind, args, kwargs):
    """A UNet block every row skips: its input stands in (never read; the rebuilt tail is)."""
    return argument(block, args, kwargs, "hidden_states")


def _skipped_down(outputs: int) -> Callable:
    def skipped(block, kind, args, kwargs):
        hidden = argument(block, args, kwargs, "hidden_states")
        return hidden, (hidden,) * outputs

    return skipped


@contextmanager
def _entered(contexts: list) -> Iterator[None]:
    if len(contexts) == 1:
        with contexts[0]:
            yield
        return
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield

