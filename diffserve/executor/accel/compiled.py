"""``--compile``: torch.compile of the denoiser's repeated blocks, rows padded to buckets.

Regional compilation, as diffusers' ``compile_repeated_blocks``: each repeated block class (the
transformer blocks; a UNet's transformer and ResNet blocks) is compiled once and every instance
runs the same graph, so compiling costs one block's time rather than the whole model's. A
forward's row count changes whenever a request joins or leaves (and, with the step cache, with
the rows that miss), so a block's rows are padded to the next power of two (1, 2, 4, 8, ...)
with copies of its last row, which are discarded: each bucket compiles once per shape
(``dynamic=False``), and steady traffic causes no recompilation.

- At start-up the engine runs one step per bucket at the model's native size, up to the rows
  one forward may carry (``--max-batch-cost``), so those compile before the first client is
  served (the time is logged). Other sizes, and bucket sizes the native size never reached,
  compile when first needed (logged as such). ``diffserve_compiles_total{when}`` counts both.
- On CUDA, ``mode="reduce-overhead"`` captures a CUDA graph per bucket; the rows a block returns
  are copied out of the graph's buffers, which its next replay overwrites.
"""

from __future__ import annotations

import logging
import time
from functools import partial

from diffserve.executor.families.blocks import CROSS, BlockKind, is_unet
from diffserve.executor.accel.wrapping import map_rows, rows_of, wrap_forward
from diffserve.executor.families import block_tables

log = logging.getLogger(__name__)

# A UNet's repeated blocks: its transformer blocks (diffusers' _repeated_blocks) and ResNets.
UNET_BLOCKS = {"BasicTransformerBlock": CROSS,
               "ResnetBlock2D": BlockKind(hidden="input_tensor")}
GRAPHS_KEPT = 256  # compiled graphs per block class: buckets x sizes in use


def bucket(rows: int) -> int:
    """The bucket ``rows`` are padded to: the next power of two."""
    return 1 << max(0, rows - 1).bit_length()


def graphs_compiled() -> int:
    """Graphs torch.compile has built in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledBlocks:
    """The repeated blocks of ``denoisers``, each class compiled once, rows padded to buckets.
    ``backend``: torch.compile's (inductor; the tests also use "eager", which traces and guards
    the same way without generating code)."""

    def __init__(self, denoisers: list, device: str, backend: str = "inductor") -> None:
        import torch

        # Every bucket of every size in use is a graph of its own; the default limit (8) would
        # silently fall back to eager.
        torch._dynamo.config.recompile_limit = GRAPHS_KEPT
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4 * GRAPHS_KEPT)
        self.cuda = str(device).startswith("cuda")
        mode = "reduce-overhead" if self.cuda and backend == "inductor" else None
        self._compiled: dict[type, object] = {}
        self._wrapped = []
        self._seen = self._start = graphs_compiled()
        for denoiser in denoisers:
            kinds = UNET_BLOCKS if is_unet(denoiser) else block_tables()[1]
            for module in denoiser.modules():
                kind = kinds.get(type(module).__name__)
                if kind is None:
                    continue
                cls = type(module)
                if cls not in self._compiled:
                    self._compiled[cls] = torch.compile(cls.forward, backend=backend, mode=mode,
                                                        dynamic=False)
                self._wrapped.append(wrap_forward(module, partial(self._padded, kind, module)))
        if not self._wrapped:
            names = ", ".join(type(d).__name__ for d in denoisers)
            raise ValueError(f"--compile: {names} has no repeated block the server knows")
        log.info("--compile: %d blocks of %s, rows in power-of-two buckets", len(self._wrapped),
                 ", ".join(sorted(c.__name__ for c in self._compiled)))

    def _padded(self, kind: BlockKind, block, original, args, kwargs):
        rows = rows_of(block, kind, args, kwargs)
        padded = bucket(rows)
        if padded != rows:
            extra = padded - rows
            args, kwargs = map_rows(block, args, kwargs, rows, kind.shared,
                                    lambda t: _pad_rows(t, extra))
        out = self._compiled[type(block)](block, *args, **kwargs)
        return _cut(out, padded, rows, self.cuda)

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


def warm_up(rt, engine) -> float:
    """Compile the native size's buckets: one step of each, through ``engine``, with as many
    images as make that bucket's rows (up to the most one forward carries at the native size).
    The seconds it took."""
    from diffserve.costs import uses_cfg
    from diffserve.work import ImageRequest, WorkItem

    info = rt.info
    per_image = 2 if uses_cfg(info.guidance_rule, info.default_guidance_scale, "") else 1
    most = max(per_image, int(info.max_batch_cost or per_image))
    start, rows = time.perf_counter(), per_image
    while rows <= bucket(most):
        images = max(1, min(rows, most) // per_image)
        request = ImageRequest(f"compile-warm-up-{rows}", info.name, info.width, info.height,
                               num_inference_steps=1, guidance_scale=info.default_guidance_scale,
                               prompt="a warm-up of the compiled blocks", n=images,
                               num_frames=info.num_frames, cache_threshold=0.0)
        engine.admit([WorkItem(request, 0, images)], [[]])
        while engine:
            engine.step()
        rows *= 2
    return time.perf_counter() - start
