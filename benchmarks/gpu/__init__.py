"""gpu_check.py's sections and what they share: the families' real-size models (``random:NAME``,
at their tiny scale with ``--tiny``), the registry a section joins with :func:`section`, and the
run's :class:`Context` (device, sizes, the models built as an executor builds them)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

from kit import in_process

# Each family's model: a released architecture with random weights (with --tiny, at its tiny scale).
FAMILIES = {"flux": "random:flux.1-dev", "qwen-image": "random:qwen-image", "wan": "random:wan2.1-14b",
            "z-image": "random:z-image-turbo"}
IMAGES = ("flux", "qwen-image")
CORE = ("flux", "qwen-image", "wan")  # a section's families unless it names its own
SECTIONS: dict[str, SimpleNamespace] = {}


def section(name: str, needs: str = "", families: tuple = CORE):
    """Register ``run(ctx, family) -> figures`` as section ``name``; ``needs``: "cuda" or "gpus"."""
    return lambda run: SECTIONS.setdefault(name, SimpleNamespace(run=run, needs=needs, families=families)).run


def failures(outcomes: list) -> list:
    return [o.code or o.error[:200] for o in outcomes if o.error]


class Context:
    def __init__(self, args) -> None:
        import time

        import torch

        self.started, self.clock = time.perf_counter(), time.perf_counter
        self.args, self.torch = args, torch
        self.cuda = torch.cuda.is_available() and not args.tiny
        self.gpus, self.device = (torch.cuda.device_count(), "cuda:0") if self.cuda else (0, "cpu")
        image, video = (tuple(int(v) for v in text.split("x")) for text in (args.size + "x0", args.video))
        self.sizes = {f: video if f == "wan" else image for f in FAMILIES}  # (width, height, frames)
        # What each family's requests set over the model's defaults: the size, and a video's frames.
        self.fields = {f: {"width": w, "height": h, **({"num_frames": frames} if frames else {})}
                       for f, (w, h, frames) in self.sizes.items()}

    def over_budget(self) -> bool:
        return bool(self.args.budget_s) and self.clock() - self.started > self.args.budget_s

    def model(self, family: str) -> str:
        return FAMILIES[family] + (":tiny" if self.args.tiny else "")

    def runtime(self, family: str, **config):
        """``family``'s model on this run's device, built as an executor builds it (``config``:
        ServerConfig's fields; quantization and offloading are the loader's)."""
        return in_process.runtime(self.model(family), self.args.torch_threads, device=self.device, **config)

    def items(self, rt, family: str, n: int, tag: str, steps: int | None = None, **fields) -> list:
        """``n`` work items at this run's size for ``family`` and --steps (or ``steps``)."""
        return in_process.items(rt, n, tag, steps or self.args.steps, **self.fields[family], **fields)

    def peak(self, run) -> tuple[float | None, object]:
        """(GB that ``run()`` took at its peak above what was allocated before (CUDA), its result)."""
        cuda = self.torch.cuda if self.cuda else None
        base = cuda and (cuda.reset_peak_memory_stats(), cuda.memory_allocated())[1]
        result = run()
        return cuda and (cuda.max_memory_allocated() - base) / 1e9, result

    def timed(self, run) -> float:
        """Seconds ``run()`` took, the device's queued work included."""
        return in_process.timed(run, self.cuda)[0]

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()
