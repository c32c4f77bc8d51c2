"""``--only rent``: the GPUs people rent, an 80 GB H100's memory enforced on a larger card
(``set_per_process_memory_fraction`` and ``--device-memory-bytes``): Qwen-Image and Wan 2.1 14B
start with their start-up check (where its float32 reference runs) and answer a request; the
memory budget's predicted peak against the measured one; FLUX.1-dev with its text encoder on the
CPU asleep at level 1 and awake, its image after against before. ``--tiny``: no cap."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from gpu import failures, judged, section
from kit import in_process

H100 = 80e9  # bytes: an 80 GB H100's memory, as its driver reports it (79.6 GiB less a margin)


def capped(ctx):
    """The process held to :data:`H100` bytes on a larger card; a callable that lifts it."""
    torch = ctx.torch
    if not ctx.cuda:
        return lambda: None
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, H100 / total))
    return lambda: torch.cuda.set_per_process_memory_fraction(1.0)


@section("rent", families=("qwen-image", "wan", "flux"), cost=(180, 40))
def rent(ctx, family: str) -> dict:
    return sleep_with_placement(ctx, family) if family == "flux" else starts_capped(ctx, family)


def starts_capped(ctx, family: str) -> dict:
    from diffserve.executor.checks import float32
    from diffserve.executor.memory.budget import unit_cost

    lift, fig = capped(ctx), {"cap GB": H100 / 1e9 if ctx.cuda else None}
    try:
        start = time.perf_counter()
        rt = ctx.runtime(family, device_memory_bytes=int(H100) if ctx.cuda else 0)
        fig.update({"start and check s": time.perf_counter() - start, "mode": rt.mode,
                    "task modes": rt.task_modes, "fallback": rt.fallback, "unavailable": rt.unavailable,
                    # Asked again as the check asked it (the weights are back in their dtype).
                    "float32 reference on": float32.place(rt, int(H100) if ctx.cuda else 0),
                    # A reference the host cannot hold is skipped ("skip"), not run there.
                    "float32 reference host GB needed": float32.host_bytes(rt.loaded.pipe) / 1e9})
        fig["one request"] = failures(in_process.run(rt, ctx.items(rt, family, 1, "rent"))) or "answered"
        info = rt.info
        if info.memory_budget_bytes:
            unit = unit_cost(info)
            batch = max(1, min(ctx.args.batch, int(info.memory_cost_bound / unit)))
            ctx.torch.cuda.reset_peak_memory_stats()
            failed = failures(in_process.run(rt, ctx.items(rt, family, batch, "budget", 2)))
            measured = ctx.torch.cuda.max_memory_allocated()
            predicted = info.memory_held_bytes + info.memory_per_cost_bytes * unit * batch
            fig.update({"budget batch": batch, "budget failed": failed, "predicted peak GB": predicted / 1e9,
                        "measured peak GB": measured / 1e9, "predicted / measured": predicted / measured})
    finally:
        lift()
    verdict = judged(fig, [("predicted / measured", ">=", 0.85), ("predicted / measured", "<=", 1.15)])
    return {**fig, "target": "starts and answers under the cap; " + verdict["target"],
            "met": verdict["met"] if fig["one request"] == "answered" else False}


def sleep_with_placement(ctx, family: str) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-rent-"))
    try:
        rt = ctx.runtime(family, skip_startup_check=True, text_encoder_device="cpu",
                         enable_weight_updates=True, weights_dir=str(scratch))
        (before,) = in_process.run(rt, ctx.items(rt, family, 1, "sleep"))
        fig = {"sleep level 1 s": ctx.timed(lambda: rt.weights.sleep(1)), "wake s": ctx.timed(rt.weights.wake)}
        (after,) = in_process.run(rt, ctx.items(rt, family, 1, "sleep"))
        if before.error or after.error:
            return {**fig, "failed": [before.error, after.error]}
        fig["largest pixel difference after the wake"] = int(abs(before.images.astype(int) - after.images).max())
        fig["text encoder on"] = str(next(rt.loaded.pipe.text_encoder.parameters()).device)
        return {**fig, **judged(fig, [("wake s", "<=", 5.0)])}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
