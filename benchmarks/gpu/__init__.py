"""gpu_check.py's sections and what they share: the families' models, the registry a section joins
(:func:`section`), and the run's :class:`Context` (device, sizes, models built as an executor builds
them, the budget, and :meth:`Context.configuration`: a configuration's JSON line, as it ends)."""

from __future__ import annotations

import gc
import json
import traceback
from types import SimpleNamespace

from kit import in_process, stats

# Each family's model: a released architecture with random weights (with --tiny, at its tiny scale).
FAMILIES = {"flux": "random:flux.1-dev", "qwen-image": "random:qwen-image", "wan": "random:wan2.1-14b",
            "z-image": "random:z-image-turbo", "flux-fill": "random:flux.1-fill-dev",
            "ltx-2": "random:ltx-2", "hunyuan-video15": "random:hunyuan-video-1.5"}
IMAGES = ("flux", "qwen-image")
VIDEOS = ("wan", "ltx-2", "hunyuan-video15")  # sized by --video
CORE = ("flux", "qwen-image", "wan")  # a section's families unless it names its own
SECTIONS: dict[str, SimpleNamespace] = {}


def section(name: str, needs: str = "", families: tuple = CORE, cost: tuple = (120, 30), lines: bool = False):
    """Register ``run(ctx, family) -> figures`` as section ``name``; ``needs``: "cuda" or "gpus"; ``cost``:
    a family's seconds expected (real size, tiny); ``lines``: its own lines, one a configuration."""
    return lambda run: SECTIONS.setdefault(name, SimpleNamespace(run=run, needs=needs, families=families,
                                                                 cost=cost, lines=lines)).run


def judged(fig: dict, checks: list) -> dict:
    """``target`` (the checks as words) and ``met`` (all met; None where a figure is missing)."""
    verdicts = [stats.judge(fig.get(key), op, bound) for key, op, bound in checks]
    return {"target": "; ".join(f"{key} {op} {bound:g}" for key, op, bound in checks),
            "met": None if None in verdicts else all(verdicts)}


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
        self.device_name = torch.cuda.get_device_name(0) if self.cuda else "cpu"
        image, video = (tuple(int(v) for v in text.split("x")) for text in (args.size + "x0", args.video))
        self.sizes = {f: video if f in VIDEOS else image for f in FAMILIES}  # (width, height, frames)
        # What each family's requests set over the model's defaults: the size, and a video's frames.
        self.fields = {f: {"width": w, "height": h, **({"num_frames": frames} if frames else {})}
                       for f, (w, h, frames) in self.sizes.items()}

    def left(self) -> float:  # of --budget-s
        return self.args.budget_s - (self.clock() - self.started) if self.args.budget_s else float("inf")

    def configuration(self, section: str, family: str, name: str, cost: tuple, run) -> dict:
        """``run()``'s figures, appended to --jsonl as one line the moment it ends (a run killed
        later keeps it); not run where its seconds expected (``cost``: real, tiny) exceed those left."""
        start, expected = self.clock(), cost[bool(self.args.tiny)]
        if expected > self.left():
            fig = {"skipped": f"expects {expected:g} s, {max(0.0, self.left()):.0f} s left of --budget-s"}
        else:
            try:
                fig = run()
            except Exception:  # noqa: BLE001 - said in its line; the next configuration runs
                fig = {"error": traceback.format_exc()[-2000:]}
        line = json.dumps({"section": section, "family": family, "config": name, "device": self.device_name,
                           "s": round(self.clock() - start, 2), **fig}, default=str)
        if self.args.jsonl:
            with open(self.args.jsonl, "a", encoding="utf-8") as out:  # closed: on disk as it ends
                print(line, file=out)
        print(line, flush=True)
        return fig

    def model(self, family: str) -> str:
        return FAMILIES[family] + (":tiny" if self.args.tiny else "")

    def runtime(self, family: str, **config):
        """``family``'s model on this run's device, built as an executor builds it (``config``:
        ServerConfig's fields; quantization and offloading are the loader's)."""
        return in_process.runtime(self.model(family), self.args.torch_threads, device=self.device, **config)

    def items(self, rt, family: str, n: int, tag: str, steps: int | None = None, **fields) -> list:
        """``n`` work items at this run's size for ``family`` and --steps (or ``steps``)."""
        return in_process.items(rt, n, tag, steps or self.args.steps, **self.fields[family], **fields)

    def timed(self, run) -> float:
        """Seconds ``run()`` took, the device's queued work included."""
        return in_process.timed(run, self.cuda)[0]

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()
