"""One denoising step of the step engine, in process: what the accelerators change.

- ``host``: the time of a step outside the denoiser and the VAE (what ``diffserve_step_host_seconds``
  records), for the engine as it is and for the step before the lean one (every step stacked
  each request's conditioning again, guided each request apart, and built the LoRA row plan and
  the gathered adapter weights afresh). Per batch size, with and without distinct LoRA adapters.
- ``compile``: the steady-state time of a step at each bucket (1, 2, 4, ... images), eager and
  with ``--compile`` (the buckets compiled beforehand, as at start-up).
- ``quantization``: the denoiser's weight bytes and the process's resident memory, and the step
  time, float against ``--quantization int8-weight-only``.
- ``cache``: the step cache's ceiling: the time of a step whose every row computes against one
  whose every row reuses its cache (the first block alone), per batch size.

Each figure is the median over ``--rounds`` rounds of the median over ``--repeats`` steps.

    python benchmarks/bench_step.py host --model shapes --batch-sizes 1,8
    python benchmarks/bench_step.py compile --model sd-mid --batch-sizes 1,2,4,8
    python benchmarks/bench_step.py quantization --model sd-mid --batch-sizes 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tools/


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("what", choices=("host", "compile", "quantization", "cache"))
    p.add_argument("--model", default="shapes")
    p.add_argument("--batch-sizes", default="1,8", help="Images per forward, comma-separated.")
    p.add_argument("--steps", type=int, default=20, help="Each request's steps (host: steps timed).")
    p.add_argument("--repeats", type=int, default=10, help="Steps timed per round (compile, "
                   "quantization).")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loras", type=int, default=4, help="host: distinct adapters (0: none).")
    p.add_argument("--torch-threads", type=int, default=0)
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)

    from diffserve.executor.process import bound_openmp_spin

    bound_openmp_spin()  # as the executor does, before torch loads
    import torch

    batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    run = {"host": host, "compile": compiled, "quantization": quantized,
           "cache": ceiling}[args.what]
    report = {"what": args.what, "model": args.model, "args": vars(args),
              "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
              "platform": platform.platform(), "load_average": os.getloadavg(),
              "results": run(args, batches)}
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report["results"], indent=1))
    if args.output_file:
        Path(args.output_file).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def runtime(args, **config):
    from diffserve.config import ServerConfig
    from diffserve.executor.runtime import build_runtime

    return build_runtime(ServerConfig(model=args.model, batching_mode="step", **config),
                         torch_threads=args.torch_threads)


def requests(rt, batch: int, steps: int, tag: str, loras=(), threshold: float | None = None):
    from diffserve.protocol import ImageRequest, WorkItem

    info = rt.info
    return [WorkItem(ImageRequest(f"{tag}-{i}", info.name, info.width, info.height,
                                  num_inference_steps=steps,
                                  guidance_scale=info.default_guidance_scale,
                                  prompt=f"a red circle {i}", seed=i,
                                  loras=(loras[i % len(loras)],) if loras else (),
                                  cache_threshold=threshold), 0, 1)
            for i in range(batch)]


def step_times(engine, items, measure, skip: int = 1) -> list[float]:
    """Admit ``items`` and step to the end; ``measure(out)`` of each step after the first
    ``skip`` and before the last (which decodes)."""
    engine.admit(items, [[] for _ in items])
    seen = []
    while engine:
        out = engine.step()
        if not out.finished:
            seen.append(measure(out))
    return seen[skip:]


# -- host time ---------------------------------------------------------------------------------


def earlier_engine(rt):
    """The step engine as it was before the lean step: each forward stacks every request's
    conditioning, guidance and adapter stacks again, guides each request apart, and the LoRA
    row plan and its gathered weights are built afresh."""
    from diffserve.executor.step_engine import StepEngine
    from diffserve.samples import chunks

    class Earlier(StepEngine):
        def _predict(self, units):
            fam, torch = self.family, self.family.torch
            inputs, timesteps, guidance, conds = [], [], [], []
            for u in units:
                t = u.prepared.timesteps[u.step]
                x = torch.cat([u.prepared.latents] * 2) if u.cfg else u.prepared.latents
                scale = getattr(u.scheduler, "scale_model_input", None)
                if scale is not None:
                    x = scale(x, t)
                inputs.append(x)
                timesteps.append(t.expand(x.shape[0]) if t.dim() == 0 else t.repeat(x.shape[0]))
                guidance.append(torch.full((x.shape[0],), u.request.guidance_scale,
                                           dtype=torch.float32, device=x.device))
                conds.extend((u.prepared.negative, u.prepared.positive) if u.cfg
                             else (u.prepared.positive,))
            r = units[0].request
            if self.adapters is not None:
                self.adapters.rows._plans.clear()  # no plan outlived its forward then
            start = self.clock()
            with self._rows([u.adapters for u in units for _ in range(u.rows)]):
                output = fam.forward(torch.cat(inputs), torch.cat(timesteps),
                                     type(conds[0]).cat(conds), torch.cat(guidance), r.width,
                                     r.height)
            self._inner_s += self.clock() - start
            predictions = []
            for u, part in zip(units, chunks(output, [u.rows for u in units])):
                if u.cfg:
                    part = fam.guide(*part.chunk(2),
                                     fam.guidance_scale(u.request, u.prepared.timesteps[u.step]))
                predictions.append(part)
            return predictions

    from diffserve.policies import set_policy

    return Earlier(rt.family, rt.count_tokens, adapters=rt.adapters,
                   policy=set_policy(rt.config.set_policy))


def host(args, batches: list[int]) -> list[dict]:
    from tools.loras import write_lora

    results = []
    for with_loras in ([False, True] if args.loras else [False]):
        config = {"skip_startup_check": True}
        names = []
        if with_loras:
            root = Path("/tmp") / f"bench-step-loras-{args.model}"
            names = [f"l{i}" for i in range(args.loras)]
            config["lora_modules"] = tuple(
                f"{n}={write_lora(args.model, root / n, rank=8, seed=i)}" for i, n in enumerate(names))
        rt = runtime(args, **config)
        stacks = [(n, 1.0) for n in names]
        for batch in batches:
            figures, forward = {"before": [], "after": []}, {"before": [], "after": []}
            for _ in range(args.rounds):
                for name, engine in (("before", earlier_engine(rt)), ("after", rt.step_engine())):
                    seen = step_times(engine, requests(rt, batch, args.steps, name, stacks),
                                      lambda out: (out.host_seconds, out.seconds))
                    figures[name].append(statistics.median(h for h, _ in seen))
                    forward[name].append(statistics.median(s - h for h, s in seen))
            rows = batch * (2 if rt.family.uses_cfg(rt.info.default_guidance_scale, "") else 1)
            row = {"batch": batch, "rows": rows, "loras": len(names),
                   **{f"host ms, {k}": 1000 * statistics.median(v) for k, v in figures.items()},
                   **{f"host ms by round, {k}": [1000 * x for x in v] for k, v in figures.items()},
                   "target ms (1.5 + 0.03 x rows)": 1.5 + 0.03 * rows,
                   **{f"forward ms, {k}": 1000 * statistics.median(v) for k, v in forward.items()}}
            print(row, flush=True)
            results.append(row)
    return results


# -- compile -----------------------------------------------------------------------------------


def compiled(args, batches: list[int]) -> list[dict]:
    results = []
    eager = runtime(args, skip_startup_check=True)
    start = time.perf_counter()
    fast = runtime(args, skip_startup_check=True, compile=True)  # warms the native buckets up
    warm_up_s = time.perf_counter() - start
    for batch in batches:  # buckets the warm-up did not reach compile here, untimed
        step_times(fast.step_engine(), requests(fast, batch, 3, "warm"), lambda out: out)
    graphs = fast.compiled.take_new()
    figures: dict[str, dict[int, list[float]]] = {"eager": {}, "compiled": {}}
    for _ in range(args.rounds):
        for name, rt in (("eager", eager), ("compiled", fast)):
            for batch in batches:
                seen = step_times(rt.step_engine(), requests(rt, batch, args.repeats + 2, name),
                                  lambda out: out.seconds)
                figures[name].setdefault(batch, []).append(statistics.median(seen))
    recompiled = fast.compiled.take_new()
    for batch in batches:
        e, c = (statistics.median(figures[k][batch]) for k in ("eager", "compiled"))
        results.append({"batch": batch, "eager step ms": 1000 * e, "compiled step ms": 1000 * c,
                        "speed-up": e / c, "eager by round": figures["eager"][batch],
                        "compiled by round": figures["compiled"][batch]})
        print(results[-1], flush=True)
    results.append({"start-up with --compile s": warm_up_s, "graphs compiled beyond the start-up's":
                    graphs, "graphs compiled while measuring": recompiled})
    return results


# -- quantization ------------------------------------------------------------------------------


def quantized(args, batches: list[int]) -> list[dict]:
    from diffserve.executor.quantization import weight_bytes

    results = []
    for scheme in ("none", "int8-weight-only"):
        before = resident_mb()
        rt = runtime(args, skip_startup_check=True, quantization=scheme)
        logical, stored = (sum(x) for x in zip(*(weight_bytes(d) for d in rt.family.denoisers)))
        row = {"quantization": scheme, "denoiser weights MB": stored / 1e6,
               "denoiser weights MB unquantized": logical / 1e6,
               "process resident MB after loading": resident_mb(),
               "resident MB added by loading": resident_mb() - before}
        for batch in batches:
            rounds = [statistics.median(step_times(rt.step_engine(),
                                                   requests(rt, batch, args.repeats + 2, scheme),
                                                   lambda out: out.seconds))
                      for _ in range(args.rounds)]
            row[f"step ms, batch {batch}"] = 1000 * statistics.median(rounds)
            row[f"step ms by round, batch {batch}"] = [1000 * r for r in rounds]
        print(row, flush=True)
        results.append(row)
        del rt
    return results


# -- the step cache's ceiling ------------------------------------------------------------------


def ceiling(args, batches: list[int]) -> list[dict]:
    rt = runtime(args, skip_startup_check=True, step_cache="first-block")
    results = []
    for batch in batches:
        computing, hitting = [], []
        for _ in range(args.rounds):
            computing.append(statistics.median(step_times(
                rt.step_engine(), requests(rt, batch, args.repeats + 2, "all", threshold=0.0),
                lambda out: out.seconds)))
            # A threshold no change reaches: every step past the first hits (the last computes).
            seen = step_times(rt.step_engine(), requests(rt, batch, args.repeats + 2, "hit",
                                                         threshold=1e9),
                              lambda out: (out.seconds, out.cache_misses))
            hitting.append(statistics.median(s for s, missed in seen if not missed))
        c, h = statistics.median(computing), statistics.median(hitting)
        results.append({"batch": batch, "step ms, every row computes": 1000 * c,
                        "step ms, every row hits": 1000 * h, "ceiling (all hit)": c / h,
                        "by round": {"computes": computing, "hits": hitting}})
        print(results[-1], flush=True)
    return results


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


if __name__ == "__main__":
    sys.exit(main())
