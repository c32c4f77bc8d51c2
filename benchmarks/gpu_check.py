"""One command for a GPU machine: FLUX.1-dev, Qwen-Image and Wan 2.1 14B (Z-Image-Turbo in the seed's
setup) at their published sizes with random weights (``random:NAME``), built as an executor builds
them, by section (``--only``): rent, speed, seed (benchmarks/gpu/), first-day, exactness, memory,
parallel (2+ GPUs); ``--tiny``: the same architectures scaled down on the CPU. A section is a
function under ``@section``, calling another tool's measurement where one measures the same; each
configuration ends in one JSON line (``--jsonl``); ``--budget-s`` starts none that would not fit
(gpu/slice.sh: a lent device's one command). docs/benchmarks.md says what each figure is.

    python benchmarks/gpu_check.py --output-file gpu-check.json
    python benchmarks/gpu_check.py --only first-day,exactness --families flux
"""

from __future__ import annotations

import statistics
import sys
import time
from importlib.metadata import version
from types import SimpleNamespace

import numpy as np

import bench_parallel
import bench_step
import gpu.rent  # noqa: F401 - each module's sections register themselves, in this order
import gpu.speed  # noqa: F401
import gpu.seed  # noqa: F401
import gpu.sizes  # noqa: F401
from gpu import CORE, FAMILIES, IMAGES, SECTIONS, Context, failures, section
from kit import cli, in_process, stats
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
    torch.cuda.reset_peak_memory_stats()
    base, _ = torch.cuda.memory_allocated(), in_process.run(rt, ctx.items(rt, family, 1, "1", 2), "request")
    one = (torch.cuda.max_memory_allocated() - base) / 1e9
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


@section("exactness", families=(*CORE, "flux-fill", "ltx-2", "hunyuan-video15"), cost=(240, 30))
def exactness(ctx, family: str) -> dict:
    """4 requests in step mode, two joining the running set after its first step, each against the
    plain pipeline alone; FLUX.1 Fill's are two inpaintings and two outpaintings (a border to fill);
    LTX-2's sound tracks against the pipeline's waveforms too."""
    from diffserve.executor.checks.reference import solo

    rt = ctx.runtime(family, dtype="bfloat16", skip_startup_check=True)
    fill = family == "flux-fill"
    its = ctx.items(rt, family, 4, "exact", **({"task": "inpaint", "strength": 1.0} if fill else {}))
    frames = fill_frames(*ctx.sizes[family][:2], its) if fill else {i.request.request_id: [] for i in its}
    rows, forward = [], rt.family.forward
    rt.family.forward = lambda latents, *a, **k: rows.append(latents.shape[0]) or forward(latents, *a, **k)
    try:
        stepped = in_process.stepped(rt.step_engine(), {0: its[:2], 1: its[2:]},
                                     inputs=lambda item: frames[item.request.request_id])
    finally:
        rt.family.forward = forward
    served = {o.item.request.request_id: o for o in stepped if not o.error}
    sound = rt.info.audio_sample_rate > 0
    alone = [solo(rt.loaded, rt.pipelines, i.request, *frames[i.request.request_id], sound=sound)
             for i in its]
    pairs = [(served[i.request.request_id].images.astype(int), a[0] if sound else a)
             for i, a in zip(its, alone)]
    fig = {"dtype": rt.loaded.dtype, "failed": failures(stepped), "most rows a forward": max(rows),
           "worst pixel diff": max(int(abs(a - b).max()) for a, b in pairs),
           "mean pixel diff": statistics.mean(float(abs(a - b).mean()) for a, b in pairs),
           "worst PSNR dB": min(stats.psnr(a, b) for a, b in pairs)}
    if sound:  # before encoding
        fig["worst waveform diff"] = max(float(abs(served[i.request.request_id].audio - a[1]).max())
                                         for i, a in zip(its, alone))
    return fig


def fill_frames(width: int, height: int, its) -> dict:
    """Each item's image and mask: the right half to inpaint, or all but the middle to outpaint."""
    rng, half = np.random.default_rng(0), np.zeros((height, width), np.uint8)
    half[:, width // 2:] = 255
    border = np.full((height, width), 255, np.uint8)
    border[height // 4:3 * height // 4, width // 4:3 * width // 4] = 0
    return {i.request.request_id: [(rng.random((height, width, 3)) * 255).astype(np.uint8),
                                   half if n % 2 == 0 else border] for n, i in enumerate(its)}


@section("memory", needs="cuda", families=IMAGES)
def offloaded(ctx, family: str) -> dict:
    """Each --offload mode: the device's peak memory (the weights it holds included) and
    bench_step.py's step (of 2), at batch 1 and 8."""
    fig, cuda = {}, ctx.torch.cuda
    for mode in ("none", "layer", "model"):
        rt = ctx.runtime(family, skip_startup_check=True, offload=mode)
        for batch in (1, 8):
            cuda.reset_peak_memory_stats()
            step = bench_step.step_s(rt, batch, mode, 2, **ctx.fields[family])
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
        status = f"skipped: needs {'2+ GPUs' if s.needs == 'gpus' else 'CUDA'}"
        ctx.configuration(name, "", "", (0, 0), lambda: {"skipped": status[9:]})
        return {"status": status}
    start, families = time.perf_counter(), {}
    for family in (f for f in s.families if f in ctx.args.families):
        print(f"=== {name}: {family}", flush=True)
        families[family] = s.run(ctx, family) if s.lines else ctx.configuration(
            name, family, "", s.cost, lambda: s.run(ctx, family))
        ctx.free()
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
    p.add_argument("--tiny", action="store_true", help="Each model at its tiny scale (random:NAME:tiny), on the CPU.")
    p.add_argument("--size", help="Images' WIDTHxHEIGHT (default 1024x1024; tiny: 64x64).")
    p.add_argument("--video", help="Wan's WIDTHxHEIGHTxFRAMES (default 832x480x33; tiny: 32x32x9).")
    p.add_argument("--batch", type=cli.count, help="Requests at once (default 4; tiny: 2); steps default 8 (2).")
    p.add_argument("--budget-s", type=float, default=0.0, help="Start no configuration that would not end "
                   "inside this many seconds (0: no limit); its line says so.")
    p.add_argument("--jsonl", help="Append each configuration's figures here as one JSON line, as it ends.")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="speed: the GPU's dense peak (0: diffserve's table).")
    args = p.parse_args(argv)
    if unknown := (set(args.only) - set(SECTIONS)) | (set(args.families) - set(FAMILIES)):
        p.error(f"unknown: {', '.join(sorted(unknown))}")
    for name, real, tiny in (("size", "1024x1024", "64x64"), ("video", "832x480x33", "32x32x9"), ("steps", 8, 2),
                             ("batch", 4, 2)):
        setattr(args, name, getattr(args, name) or (tiny if args.tiny else real))
    if args.tiny:  # --compile traced by dynamo alone: inductor's code generation takes minutes on a CPU
        from diffserve.executor.accel.compiled import CompiledBlocks

        CompiledBlocks.__init__.__defaults__ = ("eager", *CompiledBlocks.__init__.__defaults__[1:])
    ctx = Context(args)
    report = {"device": ctx.device_name, "gpus": ctx.gpus,
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
