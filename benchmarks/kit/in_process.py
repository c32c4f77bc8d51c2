"""The engines in this process, with no server around them: a model built as an executor builds
it (:func:`runtime`), its work items (:func:`items`), and a step engine stepped to the end with
arrivals between steps (:func:`stepped`)."""

from __future__ import annotations

import select
import time
from typing import Any, Callable

from diffserve.config.flags import ServerConfig
from diffserve.executor.runtime import build_runtime
from diffserve.wire.request import ImageRequest, Work, WorkItem
from kit.cli import prompts


def runtime(model: str, torch_threads: int = 0, **config):
    """``model`` built as an executor builds it, in this process (``config``: ServerConfig's fields)."""
    return build_runtime(ServerConfig(model=model, **config), torch_threads=torch_threads)


def items(rt, n: int, tag: str = "r", steps: int | None = None, first: int = 0, **fields) -> list:
    """``n`` one-image work items for ``rt``'s model: seeds from ``first``, prompts from
    prompts.txt, the model's size, guidance and (without ``steps``) steps; ``fields`` over them."""
    info, pool = rt.info, prompts()
    return [WorkItem(ImageRequest(**{
        "request_id": f"{tag}-{first + i}", "model": info.name, "width": info.width, "height": info.height,
        "num_inference_steps": steps or info.default_steps, "guidance_scale": info.default_guidance_scale,
        "prompt": pool[i % len(pool)], "seed": first + i, "num_frames": info.num_frames, **fields}), 0, 1)
        for i in range(n)]


def stepped(engine, arrivals: dict[int, list], each=lambda out: None, inputs=lambda item: []) -> list:
    """The outcomes of the work items ``arrivals`` admits before each step (by its index), stepped to
    the end; ``each(out)`` after every step. Waits, as the executor's loop does, where only a stage works."""
    outcomes, step, last = [], 0, max(arrivals, default=0)
    while engine or step <= last:
        if arriving := arrivals.get(step):
            outcomes += engine.admit(arriving, [inputs(item) for item in arriving])
        if not engine.steppable and engine.stage_pending:
            select.select([engine.wakeup.read_fd], [], [], 600)
            engine.wakeup.clear()
        out = engine.step()
        each(out)
        outcomes += out.finished
        step += 1
    return outcomes


def timed(run: Callable[[], Any], sync: bool = False) -> tuple[float, Any]:
    """(seconds, result) of ``run()``; ``sync``: the CUDA device's queued work included."""
    start = time.perf_counter()
    result = run()
    if sync:
        import torch

        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def run(rt, its: list, mode: str = "step") -> list:
    """The outcomes of work items ``its`` in ``rt``'s engine of ``mode`` (request: one pipeline call)."""
    if mode == "request":
        return rt.request_runner().execute(Work(0, its), [[] for _ in its])
    return stepped(rt.step_engine(), {0: its})
