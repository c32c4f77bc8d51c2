"""The encode and decode stages beside the step loop (--stages): how long the denoiser waits for
text encoders and VAEs, with the stages on and off.

Scenarios:

- ``gaps``: in this process, a step engine over each ``--models`` model takes ``--count``
  requests, one arriving every ``--every`` steps, each with its own prompt (and input image
  where the model edits), so that requests join and finish while others run. The figure is the
  longest gap between two consecutive denoiser forwards over the median gap before forwards of
  as many requests (a forward of more rows takes longer; only gaps with requests left running,
  an empty set waiting for an admission is idle, not stalled), stages on and off, the loop on ``--torch-threads`` threads (1: the stages get
  the other core of a 2-core CPU). Target: at most 1.5 with the stages on.
- ``prompt``: a server gets ``--count`` requests of one prompt at once; its /metrics says how
  many prompt encodings ran (the prompt cache's misses). Target: one.
- ``edits``: a step-mode server of ``--edit-model`` (stages on, then off) takes ``--count``
  edits one at a time, then at once (benchmarks/bench_edits.py's measurement); the figure is
  the time one at a time over the time at once. Target: at least 1.0 with the stages on.

    python benchmarks/bench_stages.py gaps --rounds 3
    python benchmarks/bench_stages.py prompt --rounds 3
    python benchmarks/bench_stages.py edits --rounds 3
"""

from __future__ import annotations

import asyncio
import dataclasses
import select
import statistics
import sys
import time

import httpx

import bench_edits
import kit

GAP = "longest gap / median gap"
ENCODES = "prompt encodings for one prompt"


def gap_ratio(model: str, stages: bool, count: int, every: int, steps: int, threads: int) -> dict:
    """One run of the engine (see the module's docstring), after one unmeasured run of the same
    (first sizes of sets, first decodes): its forwards' gaps."""
    gap_run(model, stages, count, every, steps, threads)
    return gap_run(model, stages, count, every, steps, threads)


def gap_run(model: str, stages: bool, count: int, every: int, steps: int, threads: int) -> dict:
    sys.path.insert(0, str(kit.HERE.parent / "tests"))
    from reference import sample_image

    from diffserve.config import ServerConfig
    from diffserve.executor.runtime import build_runtime
    from diffserve.protocol import ImageRequest, WorkItem

    rt = RUNTIMES.get((model, threads))
    if rt is None:
        rt = RUNTIMES[(model, threads)] = build_runtime(
            ServerConfig(model=model, skip_startup_check=True), torch_threads=threads)
    engine = rt.step_engine(stages=stages)
    # Each step's forward: (when, requests in it, requests still running after its step).
    forwards: list[list] = []
    predict = engine._predict

    def timed(units):
        forwards.append([time.perf_counter(), len(engine.units), 0])
        return predict(units)

    engine._predict = timed
    side, info = rt.info.width, rt.info
    edits = "edit" in info.tasks and "generate" not in info.tasks
    image = sample_image(side)[0]

    def request(i: int):
        r = ImageRequest(f"r{i}", model, side, side, task="edit" if edits else "generate",
                         references=1 if edits else 0, num_inference_steps=steps,
                         guidance_scale=4.0, prompt=f"prompt number {i}", negative_prompt="blurry",
                         seed=i)
        return dataclasses.replace(r, num_frames=5) if info.num_frames else r

    start, sent, done, step = time.perf_counter(), 0, 0, 0
    while done < count:
        if sent < count and step % every == 0:
            engine.admit([WorkItem(request(sent), 0, 1)], [[image] if edits else []])
            sent += 1
        if not engine.steppable and engine.stage_pending:  # only stage work: wait for it
            select.select([engine.wakeup.read_fd], [], [], 600)
            engine.wakeup.clear()
        out = engine.step()
        if out.samples:
            forwards[-1][2] = len(engine.units)
        done += sum(o.status == "finished" for o in out.finished)
        assert all(o.status == "finished" for o in out.finished), [o.error for o in out.finished]
        step += 1
    total = time.perf_counter() - start
    engine.close()
    # A gap counts where requests were left running after a step (they wait for the next
    # forward; an empty set waiting for an admission is idle, not stalled), set against the
    # median gap before forwards of its size (a forward of more rows is longer).
    gaps = [(b - a, size) for (a, _, left), (b, size, _) in zip(forwards, forwards[1:]) if left]
    by_size = {n: statistics.median(g for g, m in gaps if m == n) for _, n in gaps}
    worst = max(gaps, key=lambda gap: gap[0] / by_size[gap[1]])
    return {"ratio": worst[0] / by_size[worst[1]], "max_ms": worst[0] * 1e3,
            "median_ms": by_size[worst[1]] * 1e3, "total_s": total}


RUNTIMES: dict = {}


def gaps(b: kit.Bench) -> dict[str, float | None]:
    a, figures = b.args, {}
    for model in a.models:
        for stages in (True, False):
            run = gap_ratio(model, stages, a.count, a.every, a.steps or 8, a.torch_threads)
            label = f"{model}, stages {'on' if stages else 'off'}"
            print(f"[{label}] longest {run['max_ms']:.1f} ms against a median of {run['median_ms']:.1f} "
                  f"ms, ratio {run['ratio']:.2f}, total {run['total_s']:.2f} s", flush=True)
            figures[f"{GAP}, {label}"] = run["ratio"]
            figures[f"total s, {label}"] = run["total_s"]
    return figures


def prompt(b: kit.Bench) -> dict[str, float | None]:
    a = b.args
    with b.servers("prompt", {"--batching-mode": "step", "--dynamic-batch-max-size": a.count}) as served:
        url = served.urls[0]
        before = kit.metrics(url)
        body = {"prompt": f"one prompt, round {b.round}", "num_inference_steps": a.steps or 4}

        async def send():
            async with httpx.AsyncClient(timeout=600) as client:
                responses = await asyncio.gather(*(client.post(url + kit.ENDPOINT, json={**body, "seed": i})
                                                   for i in range(a.count)))
            return [r.status_code for r in responses]

        statuses = asyncio.run(send())
        after = kit.metrics(url)
    b.failed |= any(s != 200 for s in statuses)
    misses = kit.total(after, "diffserve_prompt_cache_requests_total", outcome="miss") - \
        kit.total(before, "diffserve_prompt_cache_requests_total", outcome="miss")
    hits = kit.total(after, "diffserve_prompt_cache_requests_total", outcome="hit") - \
        kit.total(before, "diffserve_prompt_cache_requests_total", outcome="hit")
    return {ENCODES: misses, "prompt cache hits": hits}


def edits(b: kit.Bench) -> dict[str, float | None]:
    a = b.args
    images, figures = bench_edits.inputs(a.count, a.side), {}
    a.steps = a.steps or 4
    for stages in ("on", "off"):
        with b.servers(f"edits-{stages}", {"--model": a.edit_model, "--batching-mode": "step",
                                           "--dynamic-batch-max-size": a.count, "--stages": stages}) as served:
            alone, at_once, _ = asyncio.run(bench_edits.timed(served.urls[0], images, a))
        print(f"[edits, stages {stages}] one at a time {alone:.2f} s, at once {at_once:.2f} s", flush=True)
        figures[f"one at a time / at once, stages {stages}"] = alone / at_once
        figures[f"at once s, stages {stages}"] = at_once
    return figures


def arguments(p) -> None:
    p.add_argument("--models", type=kit.csv(), default=["tiny-qwen-image", "tiny-qwen-image-edit", "tiny-wan"],
                   help="gaps: the models, each with the stages on and off.")
    p.add_argument("--edit-model", default="tiny-qwen-image-edit", help="edits: the model.")
    p.add_argument("--count", type=kit.count, default=8, help="Requests per run (prompt: of one prompt).")
    p.add_argument("--every", type=kit.count, default=3, help="gaps: steps between two arrivals.")
    p.add_argument("--side", type=int, default=64, help="edits: side of the inputs and outputs, pixels.")
    p.add_argument("--steps", type=int, default=None, help="Denoising steps per request (gaps: 8, else 4).")


def main(argv: list[str] | None = None) -> int:
    on = lambda name: (name, "<=", 1.5)  # noqa: E731
    return kit.main(__doc__, {
        "gaps": kit.Scenario(gaps, [on(f"{GAP}, {m}, stages on") for m in
                                    ("tiny-qwen-image", "tiny-qwen-image-edit", "tiny-wan")]),
        "prompt": kit.Scenario(prompt, [(ENCODES, "<=", 1)]),
        "edits": kit.Scenario(edits, [("one at a time / at once, stages on", ">=", 1.0)]),
    }, argv, arguments, rounds=3, torch_threads=1)


if __name__ == "__main__":
    sys.exit(main())
