"""``--compile``: torch.compile of the denoiser's repeated blocks, for a batch whose rows change
at every step.

Regional compilation, as diffusers' ``compile_repeated_blocks``: each repeated block class (the
transformer blocks; a UNet's transformer and ResNet blocks) is compiled once and every instance
runs the same graph, so compiling costs one block's time rather than the whole model's. A
forward's row count changes whenever a request joins or leaves (and, with the step cache, with
the rows that miss), so the rows cannot be a static shape:

- ``--compile-rows exact`` (the default): the rows are a dynamic dimension of the graph
  (``maybe_mark_dynamic``): a forward computes its own rows and nothing more, and a block's
  output is the graph's own (no copy). A size compiles twice at most: once for one row (which
  torch specialises) and once for any other count.
- ``--compile-rows buckets``: rows padded to the next bucket (1, 2, 3, 4, 6, 8, multiples of 4
  to 32, of 8 to 64, then steps of a quarter: :func:`buckets`) with copies of the last row,
  discarded after: each bucket is a static graph of its own (``dynamic=False``), which CUDA
  graphs need; at most a quarter of a bucket's rows are padding (9 rows cost 12, 5 cost 6).
  ``--cuda-graphs on`` captures a CUDA graph
  per bucket (``mode="reduce-overhead"``), whose output buffers its next replay overwrites, so
  the rows a block returns are copied out. Prompts of different token lengths (Qwen-Image's)
  are padded, masked, to a multiple of the family's text bucket (64 tokens) for the same reason.

Either way steady traffic causes no recompilation. At start-up the engine runs a request per
bucket its native-size requests reach (exact: one and two images), up to the rows one forward may
carry (``--max-batch-cost``), so those compile before the first client is served (the time is
logged); with CUDA graphs each runs three forwards, so that the graphs are recorded then too
(torch records a graph at its second call), and what their private memory pools keep is measured
for the memory budget (``graph_bytes``). Other sizes (and buckets only mixed guidance reaches)
compile when first needed. ``diffserve_compiles_total{when}`` counts both.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from functools import partial

from diffserve.executor.families.blocks import CROSS, BlockKind, is_unet
from diffserve.executor.accel.wrapping import map_rows, rows_of, wrap_forward
from diffserve.executor.families.known import block_tables

log = logging.getLogger(__name__)

# A UNet's repeated blocks: its transformer blocks (diffusers' _repeated_blocks) and ResNets.
UNET_BLOCKS = {"BasicTransformerBlock": CROSS,
               "ResnetBlock2D": BlockKind(hidden="input_tensor")}
GRAPHS_KEPT = 256  # compiled graphs per block class: buckets x sizes in use


def buckets(most: int) -> list[int]:
    """Every bucket up to the first that holds ``most`` rows: 1, 2, 3, 4, 6, 8, then multiples
    of 4 to 32, of 8 to 64, and past that steps of a quarter rounded up to a multiple of 8 (80,
    104, 136, ...). At most :data:`WASTE` of a forward's rows are padding (9 rows in 12); powers
    of two padded up to 7 rows in 16."""
    found, size = [], 1
    while True:
        found.append(size)
        if size >= most:
            return found
        size = (size + 1 if size < 4 else size + 2 if size < 8 else size + 4 if size < 32 else
                size + 8 if size < 64 else -(-size * 5 // 32) * 8)


WASTE = 0.25  # the most of a bucket's rows that are padding


def bucket(rows: int) -> int:
    """The bucket ``rows`` are padded to: the least of :func:`buckets` that holds them."""
    return buckets(rows)[-1]


def graphs_compiled() -> int:
    """Graphs torch.compile has built in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


EXACT, BUCKETS = "exact", "buckets"


class CompiledBlocks:
    """The repeated blocks of ``denoisers``, each class compiled once; ``rows``: ``exact`` (a
    dynamic row dimension) or ``buckets`` (padded to :func:`buckets`); ``graphs``: CUDA graphs per
    bucket (CUDA, buckets only). ``backend``: torch.compile's (inductor; the tests also use
    "eager", which traces and guards the same way without generating code)."""

    def __init__(self, denoisers: list, device: str, backend: str = "inductor",
                 rows: str = EXACT, graphs: bool = False) -> None:
        import torch

        # Every bucket of every size in use is a graph of its own; the default limit (8) would
        # silently fall back to eager.
        torch._dynamo.config.recompile_limit = GRAPHS_KEPT
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4 * GRAPHS_KEPT)
        self.rows = BUCKETS if graphs else rows
        # Copies out of a CUDA graph's buffers, which the next replay overwrites.
        self.copy = graphs and str(device).startswith("cuda") and backend == "inductor"
        mode = "reduce-overhead" if self.copy else None
        self._compiled: dict[type, object] = {}
        self._wrapped = []
        self.bypassed = False  # the blocks' own forwards (the float32 reference's)
        self.graph_bytes = 0  # what the CUDA graphs' pools keep, measured by the warm-up
        self._seen = self._start = graphs_compiled()
        for denoiser in denoisers:
            kinds = UNET_BLOCKS if is_unet(denoiser) else block_tables()[1]
            for module in denoiser.modules():
                kind = kinds.get(type(module).__name__)
                if kind is None:
                    continue
                cls = type(module)
                if cls not in self._compiled:
                    self._compiled[cls] = torch.compile(
                        cls.forward, backend=backend, mode=mode,
                        dynamic=False if self.rows == BUCKETS else None)
                around = self._padded if self.rows == BUCKETS else self._exact
                self._wrapped.append(wrap_forward(module, partial(around, kind, module)))
        if not self._wrapped:
            names = ", ".join(type(d).__name__ for d in denoisers)
            raise ValueError(f"--compile: {names} has no repeated block the server knows")
        log.info("--compile: %d blocks of %s, %s", len(self._wrapped),
                 ", ".join(sorted(c.__name__ for c in self._compiled)),
                 "rows as a dynamic dimension" if self.rows == EXACT else
                 "rows in buckets" + (", a CUDA graph each" if self.copy else ""))

    def _exact(self, kind: BlockKind, block, original, args, kwargs):
        from torch._dynamo import maybe_mark_dynamic

        if self.bypassed:
            return original(*args, **kwargs)
        rows = rows_of(block, kind, args, kwargs)
        if rows > 1:  # one row is specialised by torch anyway; marking it would only warn
            map_rows(block, args, kwargs, rows, kind.shared,
                     lambda t: maybe_mark_dynamic(t, 0) or t)
        return self._compiled[type(block)](block, *args, **kwargs)

    def _padded(self, kind: BlockKind, block, original, args, kwargs):
        if self.bypassed:
            return original(*args, **kwargs)
        rows = rows_of(block, kind, args, kwargs)
        padded = bucket(rows)
        if padded != rows:
            extra = padded - rows
            args, kwargs = map_rows(block, args, kwargs, rows, kind.shared,
                                    lambda t: _pad_rows(t, extra))
        out = self._compiled[type(block)](block, *args, **kwargs)
        return _cut(out, padded, rows, self.copy)

    @contextmanager
    def eager(self):
        """The blocks uncompiled for the block: the start-up check's float32 reference runs
        once, and compiling it would build a second set of graphs (float32 inputs) for it."""
        self.bypassed = True
        try:
            yield
        finally:
            self.bypassed = False

    def text_multiple(self, family) -> int:
        """What ``family``'s prompt lengths are padded to: its text bucket with static shapes
        (each length would be a graph of its own), else 1 (a dynamic dimension after the second
        length, as torch marks a size that changes)."""
        return (family.text_bucket or 1) if self.rows == BUCKETS else 1

    def take_new(self) -> int:
        """Graphs compiled since the last call."""
        now = graphs_compiled()
        new, self._seen = now - self._seen, now
        return new

    def graphs_at_start(self) -> int:
        """Graphs compiled since these blocks were wrapped (at start-up: the warm-up's)."""
        return graphs_compiled() - self._start

    def close(self) -> None:
        for wrapped in reversed(self._wrapped):
            wrapped.restore()
        self._wrapped = []


def _pad_rows(tensor, extra: int):
    import torch

    return torch.cat([tensor, tensor[-1:].expand(extra, *tensor.shape[1:])])


def _cut(out, padded: int, rows: int, copy: bool):
    """A block's output cut back to its real rows (copied out of a CUDA graph's buffers)."""
    if hasattr(out, "shape"):
        if out.dim() and out.shape[0] == padded:
            out = out[:rows]
        return out.clone() if copy else out
    if isinstance(out, tuple):
        return tuple(_cut(part, padded, rows, copy) for part in out)
    return out


# Forwards per bucket at start-up: with CUDA graphs, torch runs a graph's first call as a warm-up,
# records it on the second and replays from the third, so the first served step replays.
GRAPH_FORWARDS = 3


def warm_up_images(per_image: int, most: int, rows: str) -> list[int]:
    """The images of each warm-up request: one per bucket the native size's requests reach, up
    to ``most`` rows a forward (``per_image``: rows an image takes); exact rows: one image and
    two (torch's specialised graph for one row, and the dynamic one)."""
    if rows != BUCKETS:
        return [1, 2] if 2 * per_image <= most else [1]
    found, seen = [], set()
    for images in range(1, max(1, most // per_image) + 1):
        if bucket(images * per_image) not in seen:
            seen.add(bucket(images * per_image))
            found.append(images)
    return found


def warm_up_forwards(compiled) -> int:
    """Forwards each warm-up request runs: enough that CUDA graphs are recorded at start-up."""
    return GRAPH_FORWARDS if compiled.copy else 1


def warm_up(rt, engine) -> float:
    """Compile the native size's buckets (:func:`warm_up_images`) through ``engine``, with CUDA
    graphs recorded (:func:`warm_up_forwards`), and measure what the graphs' private memory
    pools keep (``graph_bytes``, which the memory budget counts as held). The seconds it took."""
    from diffserve.device.stats import DeviceStats
    from diffserve.wire.costs import uses_cfg
    from diffserve.wire.request import ImageRequest, WorkItem

    info, compiled = rt.info, rt.compiled
    per_image = 2 if uses_cfg(info.guidance_rule, info.default_guidance_scale, "") else 1
    most = max(per_image, int(info.max_batch_cost or per_image))
    stats = DeviceStats(rt.loaded.device)
    pooled = stats.unfreed() if compiled.copy else None
    start = time.perf_counter()
    for images in warm_up_images(per_image, most, compiled.rows):
        request = ImageRequest(f"compile-warm-up-{images}", info.name, info.width, info.height,
                               num_inference_steps=warm_up_forwards(compiled),
                               guidance_scale=info.default_guidance_scale,
                               prompt="a warm-up of the compiled blocks", n=images,
                               num_frames=info.num_frames, cache_threshold=0.0)
        engine.admit([WorkItem(request, 0, images)], [[]])
        while engine:
            engine.step()
    seconds = time.perf_counter() - start
    if pooled is not None:
        compiled.graph_bytes = max(0, stats.unfreed() - pooled)
    return seconds
