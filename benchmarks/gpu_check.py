"""One command for a GPU machine: FLUX.1-dev, Qwen-Image and Wan 2.1 14B (Z-Image-Turbo in the seed's
setup) at their published sizes with random weights (the model source ``random:NAME``), built as
an executor builds them, by section (``--only``): rent, speed, seed (benchmarks/gpu/), first-day,
exactness, throughput, stages, weights, memory, parallel (2+ GPUs); ``--tiny``: the
same architectures scaled down (``random:NAME:tiny``) on the CPU, the same code in seconds. A
section is a function under ``@section``; where another tool measures the same, the section
calls that tool's measurement (bench_offline, bench_step, bench_stages, bench_parallel,
bench_seed). ``--budget-s`` starts nothing past its time. docs/benchmarks.md says what each
figure is.

    python benchmarks/gpu_check.py --output-file gpu-check.json
    python benchmarks/gpu_check.py --only first-day,exactness --families flux
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import bench_offline
import bench_parallel
import bench_stages
import bench_step
import gpu.rent  # noqa: F401 - each module's sections register themselves, in this order
import gpu.speed  # noqa: F401
import gpu.seed  # noqa: F401
from gpu import FAMILIES, IMAGES, SECTIONS, Context, failures, section
from kit import cli, in_process, stats
from diffserve.wire import shared_tensors
from diffserve.wire.weight_commands import PATH, SHARED, WeightSource
from diffserve.executor.memory import oom as memory

@section("first-day")
def first_day(ctx, family: str) -> dict:
    start, fig, rt = time.perf_counter(), {}, None
    try:
        rt = ctx.runtime(family)
    except Exception as error:  # noqa: BLE001 - reported; the rest runs without the check
        fig["start-up check"] = f"failed: {type(error).__name__}: {error}"[:300]
    if rt is None:  # the failed one's memory is free once the error is gone
        ctx.free()
        rt = ctx.runtime(family, skip_startup_check=True)
    fig.update({"dtype": rt.loaded.dtype, "load and check s": time.perf_counter() - start, "mode": rt.mode,
                "task modes": rt.task_modes, "fallback": rt.fallback, "unavailable": rt.unavailable})
    failed = failures(in_process.run(rt, ctx.items(rt, family, 1, "finite")))
    fig.update({"non-finite": failed.count("non_finite_output"), "failed": failed})
    host, rows, denoiser = [], [], rt.family.denoisers[0]  # a step: the denoiser by perf_counter alone, the timer
    hooks = [denoiser.register_forward_pre_hook(lambda *a: host.append(-time.perf_counter())),
             denoiser.register_forward_hook(lambda *a: host.append(host.pop() + time.perf_counter()))]

    def timed(out):
        if out.samples:
            rows.append((sum(host), out.seconds - out.host_seconds, out.seconds))
            host.clear()
    its = ctx.items(rt, family, ctx.args.batch, "timing", max(4, ctx.args.steps))
    in_process.stepped(rt.step_engine(), {0: its}, timed)
    for hook in hooks:
        hook.remove()
    for i, name in enumerate(("denoiser ms, perf_counter alone", "denoiser+VAE ms, StepTimer", "step ms, synced")):
        fig[name] = 1e3 * statistics.median(r[i] for r in rows[1:-1])  # neither the first step nor the decode
    fig["out-of-memory split"] = (oom_split(ctx, rt, family) if ctx.cuda else "skipped: needs CUDA") \
        if family in IMAGES else "images only"
    return fig


def oom_split(ctx, rt, family: str) -> dict:
    torch = ctx.torch
    torch.cuda.empty_cache()
    retries, release = [], memory.release
    one, _ = ctx.peak(lambda: in_process.run(rt, ctx.items(rt, family, 1, "1", 2), "request"))
    cap = torch.cuda.memory_allocated() + 2.5e9 * one
    memory.release = lambda error: retries.append(memory.is_out_of_memory(error)) or release(error)
    fig = {"cap GB": cap / 1e9, "requests": 8}
    try:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.get_device_properties(0).total_memory))
        for mode in ("request", "step"):
            retries.clear()
            failed = failures(in_process.run(rt, ctx.items(rt, family, 8, mode, 2), mode))
            fig.update({f"{mode}: out-of-memory retries": sum(retries), f"{mode}: failed": failed})
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        memory.release = release
    return fig


@section("exactness")
def exactness(ctx, family: str) -> dict:
    from diffserve.executor.checks.reference import solo

    rt = ctx.runtime(family, dtype="bfloat16", skip_startup_check=True)
    its = ctx.items(rt, family, 4, "exact")  # two join the running set after its first step
    stepped = in_process.stepped(rt.step_engine(), {0: its[:2], 1: its[2:]})
    served = {o.item.request.request_id: o.images for o in stepped}
    pairs = [(served[i.request.request_id].astype(int), solo(rt.loaded, rt.pipelines, i.request)) for i in its]
    return {"dtype": rt.loaded.dtype, "worst pixel diff": max(int(abs(a - b).max()) for a, b in pairs),
            "mean pixel diff": statistics.mean(float(abs(a - b).mean()) for a, b in pairs),
            "worst PSNR dB": min(stats.psnr(a, b) for a, b in pairs)}


@section("throughput", families=IMAGES)
def throughput(ctx, family: str) -> dict:
    """bench_offline.py's measurement in each mode: --batch requests at once, one untimed run,
    then --repeats timed; the weights' memory and each mode's peak above it."""
    rt, b = ctx.runtime(family, skip_startup_check=True), ctx.args.batch
    fig = {"weights GB": ctx.torch.cuda.memory_allocated() / 1e9} if ctx.cuda else {}
    for mode in ("request", "step"):
        peak, row = ctx.peak(lambda m=mode: bench_offline.measure(rt, m, b, ctx.args.steps, 1, ctx.args.repeats,
                                                                  **ctx.fields[family]))
        fig.update({f"img/s, {mode}": row["images_per_s"], f"peak GB above, {mode}": peak})
    return {**fig, "step / request": fig["img/s, step"] / fig["img/s, request"]}


@section("stages", families=IMAGES)
def stages(ctx, family: str) -> dict:
    """bench_stages.py's arrivals: twice --batch requests, one arriving every other step, with the
    encode and decode stages on (their own CUDA streams) and off: images/s, p99 latency, and the
    denoiser's longest pause against its median."""
    rt, runs = ctx.runtime(family, skip_startup_check=True), {True: [], False: []}
    for on in (True, False) * (1 + ctx.args.repeats):  # the first of each warms up
        its = ctx.items(rt, family, 2 * ctx.args.batch, f"stages-{on}")
        runs[on].append(bench_stages.arrivals(rt, on, its, 2))
    fig = {f"{what}, stages {'on' if on else 'off'}": statistics.median(r[key] for r in runs[on][1:])
           for on in (True, False)
           for what, key in (("img/s", "images_per_s"), ("p99 s", "p99_s"), (bench_stages.GAP, "ratio"))}
    return {**fig, "img/s, on / off": fig["img/s, stages on"] / fig["img/s, stages off"]}


@section("weights", families=IMAGES)
def weights(ctx, family: str) -> dict:
    """The whole denoiser updated from disk and from shared memory, a sleep at level 1, its wake."""
    from safetensors.torch import save_file

    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-weights-"))
    rt = ctx.runtime(family, skip_startup_check=True, enable_weight_updates=True, weights_dir=str(scratch))
    state = {k: v.detach().cpu() for k, v in rt.family.denoisers[0].state_dict().items()}
    (scratch / "transformer").mkdir()
    save_file(state, str(scratch / "transformer" / "diffusion_pytorch_model.safetensors"))
    shared = shared_tensors.SHARED_DIR / shared_tensors.write(state)
    fig = {"denoiser GB": sum(v.numel() * v.element_size() for v in state.values()) / 1e9}
    for name, source in (("disk", WeightSource(PATH, str(scratch))),
                         ("shared memory", WeightSource(SHARED, str(shared)))):
        fig[f"update from {name} s"] = ctx.timed(lambda s=source: (rt.weights.prepare(s), rt.weights.commit(name)))
    fig.update({"sleep level 1 s": ctx.timed(lambda: rt.weights.sleep(1)), "wake s": ctx.timed(rt.weights.wake)})
    shared.unlink(missing_ok=True)
    shutil.rmtree(scratch, ignore_errors=True)
    return fig


@section("memory", needs="cuda", families=IMAGES)
def offloaded(ctx, family: str) -> dict:
    """Each --offload mode: the device's peak memory (the weights it holds included) and
    bench_step.py's median step (of 2), at batch 1 and 8."""
    fig, cuda = {}, ctx.torch.cuda
    for mode in ("none", "layer", "model"):
        rt = ctx.runtime(family, skip_startup_check=True, offload=mode)
        for batch in (1, 8):
            cuda.reset_peak_memory_stats()
            step = bench_step.median_step(rt, batch, mode, 2, **ctx.fields[family])
            fig[f"{mode}: peak GB, batch {batch}"] = cuda.max_memory_allocated() / 1e9
            fig[f"{mode}: step ms, batch {batch}"] = 1e3 * step
        del rt
        ctx.free()
    return fig


@section("parallel", needs="gpus")
def parallel(ctx, family: str) -> dict:
    """bench_parallel.py's measurement of the denoiser at --size (Wan: --video), one row."""
    ranks = max(g for g in (2, 4, 8) if g <= ctx.gpus)  # each divides 24 (FLUX.1, Qwen-Image) and 40 (Wan) heads
    width, height, frames = ctx.sizes[family]
    args = SimpleNamespace(ranks=ranks, wh=(width, height), frames=frames or None, batch=1, warmup=1, repeats=3,
                           torch_threads=0, timeout=600.0)
    result = bench_parallel.measure(bench_parallel.loader(ctx.model(family)), args)
    return {**result["figures"], "collectives": result["collectives"]}


def run_section(ctx, name: str) -> dict:
    s = SECTIONS[name]
    if s.needs and not (ctx.gpus > 1 if s.needs == "gpus" else ctx.cuda):
        return {"status": f"skipped: needs {'2+ GPUs' if s.needs == 'gpus' else 'CUDA'}"}
    start, families = time.perf_counter(), {}
    for family in (f for f in s.families if f in ctx.args.families):
        if ctx.over_budget():  # said, not silently cut: the report shows what did not run
            families[family] = {"skipped": f"--budget-s {ctx.args.budget_s:g} spent"}
            continue
        print(f"=== {name}: {family}", flush=True)
        try:
            families[family] = s.run(ctx, family)
        except Exception:  # noqa: BLE001 - reported, and the next family runs
            families[family] = {"error": traceback.format_exc()[-2000:]}
        ctx.free()
        print(json.dumps(families[family], default=str), flush=True)
    rows = [{"family": f, **{k: v for k, v in fig.items() if isinstance(v, (int, float, str)) and k != "error"},
             **({"error": fig["error"].strip().splitlines()[-1][:80]} if "error" in fig else {})}
            for f, fig in families.items()]
    return {"status": "ran", "seconds": time.perf_counter() - start, "families": families,
            "table": stats.table(rows) if rows else ""}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, steps=None, repeats=2, torch_threads=0, output_file=None)
    p.add_argument("--only", type=cli.names, default=list(SECTIONS), help=f"Of {', '.join(SECTIONS)}.")
    p.add_argument("--families", type=cli.names, default=list(FAMILIES),
                   help=f"Of {', '.join(f'{f} ({m})' for f, m in FAMILIES.items())}.")
    p.add_argument("--tiny", action="store_true", help="Each model at its tiny scale (random:NAME:tiny), on the "
                                                       "CPU (a smoke run).")
    p.add_argument("--size", help="Images' WIDTHxHEIGHT (default 1024x1024; tiny: 64x64).")
    p.add_argument("--video", help="Wan's WIDTHxHEIGHTxFRAMES (default 832x480x33; tiny: 32x32x9).")
    p.add_argument("--batch", type=cli.count, help="Requests at once (default 4; tiny: 2); steps default 8 (2).")
    p.add_argument("--budget-s", type=float, default=0.0, help="Start no section's family after this many "
                                                              "seconds (0: no limit); what is skipped is reported.")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="speed: the GPU's dense peak in the served dtype "
                                                                 "(0: diffserve's table of GPUs).")
    args = p.parse_args(argv)
    if unknown := (set(args.only) - set(SECTIONS)) | (set(args.families) - set(FAMILIES)):
        p.error(f"unknown: {', '.join(sorted(unknown))}")
    for name, real, tiny in (("size", "1024x1024", "64x64"), ("video", "832x480x33", "32x32x9"), ("steps", 8, 2),
                             ("batch", 4, 2)):
        setattr(args, name, getattr(args, name) or (tiny if args.tiny else real))
    ctx = Context(args)
    report = {"device": ctx.torch.cuda.get_device_name(0) if ctx.cuda else "cpu", "gpus": ctx.gpus,
              **{name: version(name) for name in ("torch", "diffusers", "transformers")}, "config": vars(args),
              "models": {f: ctx.model(f) for f in args.families}, **cli.machine(),
              "sections": {name: run_section(ctx, name) for name in args.only}}
    shown = f"\n{report['device']}, torch {report['torch']}, diffusers {report['diffusers']}" + "".join(
        f"\n\n{name}: {r['status']}" + (f", {r['seconds']:.0f} s\n\n{r['table']}" if "table" in r else "")
        for name, r in report["sections"].items())
    failed = any("error" in fig for r in report["sections"].values() for fig in r.get("families", {}).values())
    return cli.done(args, report, shown, int(failed))


if __name__ == "__main__":
    sys.exit(main())
