"""The encode and decode stages beside the step loop (--stages), on and off: ``gaps`` (in process,
the denoiser's longest pause between forwards as requests join and finish), ``prompt`` (the prompt
encodings of many requests of one prompt).

    python benchmarks/bench_stages.py gaps --rounds 3
"""

from __future__ import annotations

import functools
import sys
import time

import numpy as np

from kit import cli, in_process, server_metrics, servers, stats

GAP = "longest gap / median gap"
ENCODES = "prompt encodings for one prompt"
RUNTIME = functools.cache(in_process.runtime)  # one per model and thread count, for every run and round


def arrivals(rt, stages: bool, its: list, every: int, inputs=lambda item: []) -> dict:
    """Work items ``its`` through a step engine over ``rt``, one arriving every ``every`` steps,
    with the encode and decode stages on or off: the denoiser's longest pause between two
    forwards while requests are left running, against the median pause before forwards of as
    many requests (a forward of more rows is longer); images/s; the p99 latency from a request's
    arrival (the start of its step) to the end of the step it finished in."""
    engine = rt.step_engine(stages=stages)
    forwards: list[list] = []  # per forward: [when, requests in it, requests running after its step]
    begun, finished = [time.perf_counter()], {}  # begun[k]: when step k began (the one before ended)

    def timed(units, predict=engine._predict):
        forwards.append([time.perf_counter(), len(engine.units), 0])
        return predict(units)

    def each(out):
        begun.append(time.perf_counter())
        finished.update((o.item.request.request_id, begun[-1]) for o in out.finished)
        if out.samples:
            forwards[-1][2] = len(engine.units)

    engine._predict = timed
    outcomes = in_process.stepped(engine, {every * i: [item] for i, item in enumerate(its)}, each, inputs)
    engine.close()
    assert all(o.status == "finished" for o in outcomes), [o.error for o in outcomes]
    total = begun[-1] - begun[0]
    gaps = [(t1 - t0, size) for (t0, _, left), (t1, size, _) in zip(forwards, forwards[1:]) if left]
    by_size = {n: stats.median([g for g, m in gaps if m == n]) for _, n in gaps}
    worst = max(gaps, key=lambda gap: gap[0] / by_size[gap[1]])
    latencies = [finished[item.request.request_id] - begun[every * i] for i, item in enumerate(its)]
    return {"ratio": worst[0] / by_size[worst[1]], "max_ms": worst[0] * 1e3,
            "median_ms": by_size[worst[1]] * 1e3, "total_s": total, "images_per_s": len(its) / total,
            "p99_s": float(np.percentile(latencies, 99))}


def gap_run(a, model: str, stages: bool) -> dict:
    """One run of the engine (see ``gaps``): :func:`arrivals` of --count requests, one every
    --every steps, with guidance and a negative prompt (an edit model's with an input image)."""
    from diffserve.executor.checks.reference import sample_image

    rt = RUNTIME(model, a.torch_threads, skip_startup_check=True)
    info = rt.info
    edits = "edit" in info.tasks and "generate" not in info.tasks
    image = sample_image(info.width)[0]
    its = in_process.items(rt, a.count, "r", a.steps or 8, guidance_scale=4.0, negative_prompt="blurry",
                           **({"task": "edit", "references": 1} if edits else {}),
                           **({"num_frames": 5} if info.num_frames else {}))
    return arrivals(rt, stages, its, a.every, lambda item: [image] if edits else [])


def gaps(b: servers.Bench) -> dict[str, float | None]:
    figures = {}
    for model in b.args.models:
        for stages in (True, False):
            for _ in range(2):  # the first unmeasured (first sizes of sets, first decodes)
                run = gap_run(b.args, model, stages)
            label = f"{model}, stages {'on' if stages else 'off'}"
            print(f"[{label}] longest {run['max_ms']:.1f} ms against a median of {run['median_ms']:.1f} "
                  f"ms, ratio {run['ratio']:.2f}, total {run['total_s']:.2f} s", flush=True)
            figures[f"{GAP}, {label}"], figures[f"total s, {label}"] = run["ratio"], run["total_s"]
    return figures


def prompt(b: servers.Bench) -> dict[str, float | None]:
    with b.servers("prompt", {"--batching-mode": "step", "--dynamic-batch-max-size": b.args.count}) as served:
        before = server_metrics.metrics(served.urls[0])
        b.load(served, "one prompt", num_prompts=b.args.count, warmup=0, steps=b.args.steps or 4,
               extra_body={"prompt": f"one prompt, round {b.round}"})  # all at once, seeds apart
        after = server_metrics.metrics(served.urls[0])
    cache = functools.partial(server_metrics.change, before, after, "diffserve_prompt_cache_requests_total")
    return {ENCODES: cache(outcome="miss"), "prompt cache hits": cache(outcome="hit")}


def arguments(p) -> None:
    p.add_argument("--models", type=cli.names, default=["tiny-qwen-image", "tiny-qwen-image-edit", "tiny-wan"],
                   help="gaps: the models, each with the stages on and off.")
    p.add_argument("--every", type=cli.count, default=3, help="gaps: steps between two arrivals.")
    p.add_argument("--steps", type=int, default=None, help="Denoising steps per request (gaps: 8, prompt: 4).")


def main(argv: list[str] | None = None) -> int:
    on = [(f"{GAP}, {m}, stages on", "<=", 1.5) for m in ("tiny-qwen-image", "tiny-qwen-image-edit", "tiny-wan")]
    return servers.main(__doc__, {"gaps": servers.Scenario(gaps, on),
                                  "prompt": servers.Scenario(prompt, [(ENCODES, "<=", 1)])},
                        argv, arguments, rounds=3, count=8, torch_threads=1)


if __name__ == "__main__":
    sys.exit(main())
