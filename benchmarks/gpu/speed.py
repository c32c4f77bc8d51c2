"""``--only speed``: how close a step runs to the GPU's peak, one JSON line a configuration, in the
order of what they decide: plain diffusers eager in the served dtype (the baseline: a step as the
difference of two calls that differ only in their step count), then diffserve's builds (CONFIGS;
bench_step.py's step, built as the server builds it), each at two shapes (images: --size at
--batch, half of it at batch 1; Wan: --video at 1): its start, step, speed-ups (over eager
diffusers, and over the build it adds one thing to), MFU, one image's PSNR against eager
diffusers', its targets. Qwen-Image runs with true CFG (a negative prompt): two rows an image."""

from __future__ import annotations

import bench_step
from gpu import IMAGES, judged, section
from kit import in_process, stats

LOSSLESS = {"attention_backend": "auto", "compile": True}  # nothing quantized
# name: (ServerConfig's fields, the build it adds one thing to, seconds expected (real, tiny)); fp8
# weight-only saves memory, not time: against the same build unquantized.
CONFIGS = {"lossless": (LOSSLESS, "", (150, 40)), "fp8": ({**LOSSLESS, "quantization": "fp8"}, "lossless", (150, 40)),
           "int8": ({**LOSSLESS, "quantization": "int8-dynamic"}, "lossless", (150, 40)),
           "cuda graphs": ({**LOSSLESS, "cuda_graphs": "on"}, "lossless", (150, 40)),  # CUDA alone
           "buckets": ({**LOSSLESS, "compile_rows": "buckets"}, "lossless", (150, 40)),
           "diffserve eager": ({}, "", (60, 15)),
           "fp8 weight-only (memory)": ({"quantization": "fp8-weight-only"}, "diffserve eager", (60, 15))}
FIRST, SMALL = "shape 1", "shape 2"  # the figures' prefixes: --size at --batch, half of it at batch 1
TARGETS = {"lossless": [(f"x eager, {FIRST}", ">=", 1.25), (f"MFU, {FIRST}", ">=", 0.55), (f"x eager, {SMALL}", ">=", 1.5)],
           "fp8": [(f"x eager, {FIRST}", ">=", 1.6), ("PSNR dB vs eager", ">=", 30.0)]}


def shapes(ctx, family: str) -> dict:
    """prefix: (request fields, batch)."""
    f = ctx.fields[family]
    half = {"width": f["width"] // 2, "height": f["height"] // 2}
    return {FIRST: (f, ctx.args.batch), SMALL: (half, 1)} if family in IMAGES else {FIRST: (f, 1)}


def plain_step_s(ctx, rt, fields: dict, batch: int, steps: int) -> float:
    """One step of the pipeline's own call at ``batch``: (a call of ``2 + steps`` steps less one
    of 2) / ``steps``, latents out (no decode), median of --repeats."""
    torch, info, pipe = ctx.torch, rt.info, rt.loaded.pipe

    def call(n: int) -> float:
        kwargs = {"prompt": ["a photograph of a red fox in the snow"] * batch, "num_inference_steps": n,
                  **fields, rt.family.guidance_kwarg: info.default_guidance_scale,
                  "generator": [torch.Generator(rt.loaded.device).manual_seed(i) for i in range(batch)],
                  "output_type": "latent", **rt.loaded.call_kwargs}
        if "negative_prompt" in fields:
            kwargs["negative_prompt"] = [fields["negative_prompt"]] * batch
        return ctx.timed(lambda: pipe(**kwargs))

    call(2)  # untimed: the first call of every kernel
    return stats.median([(call(2 + steps) - call(2)) / steps for _ in range(max(1, ctx.args.repeats))])


def mfu(ctx, rt, fields: dict, batch: int, seconds: float, quantization: str = "none") -> float | None:
    from diffserve.executor.accel import flops

    if rt.flops is None or not seconds:
        return None
    step = flops.step_flops(rt.flops, rt.info, batch, fields["width"], fields["height"], fields.get("num_frames", 0),
                            fields.get("guidance_scale"), fields.get("negative_prompt", ""))
    peak = flops.peak_flops(rt.loaded.device, rt.loaded.dtype, quantization, ctx.args.peak_tflops)
    return step / seconds / peak if peak else None


@section("speed", families=(*IMAGES, "wan"), lines=True)
def speed(ctx, family: str) -> dict:
    from diffserve.executor.checks.reference import solo

    steps, lines = max(2, ctx.args.steps), {}
    extra = {"negative_prompt": " "} if family == "qwen-image" else {}  # true CFG on
    held = {"extra": extra}  # and the probe, its image by eager diffusers

    def eager() -> dict:
        rt = ctx.runtime(family, skip_startup_check=True)
        fig = {"dtype": rt.loaded.dtype}
        for at, (fields, batch) in shapes(ctx, family).items():
            fig[f"step ms, {at}"] = 1e3 * plain_step_s(ctx, rt, {**fields, **extra}, batch, steps)
            fig[f"MFU, {at}"] = mfu(ctx, rt, {**fields, **extra}, batch, fig[f"step ms, {at}"] / 1e3)
            fig[f"{at}"] = f"{fields['width']}x{fields['height']} batch {batch}"
        (held["probe"],) = ctx.items(rt, family, 1, "speed-psnr", steps, **extra)
        held["reference"] = solo(rt.loaded, rt.pipelines, held["probe"].request)
        return fig

    lines["diffusers eager"] = ctx.configuration("speed", family, "diffusers eager", (90, 20), eager)
    ctx.free()
    for name, (config, against, cost) in CONFIGS.items():
        if "reference" not in held:
            break  # the baseline failed: its line says why
        run = (lambda: {"skipped": "needs CUDA"}) if config.get("cuda_graphs") and not ctx.cuda else (
            lambda n=name, c=config, a=against: measure(ctx, family, n, c, a, lines, held))
        lines[name] = ctx.configuration("speed", family, name, cost, run)
        ctx.free()
    return {f"{name}: {key}": value for name, fig in lines.items() for key, value in fig.items()}


def measure(ctx, family, name, config, against, lines, held) -> dict:
    """``name``'s start, its step at each shape against eager diffusers' (and ``against``'s),
    its MFU and its image's PSNR."""
    try:  # its start: the start-up compile included
        start, rt = in_process.timed(lambda: ctx.runtime(family, skip_startup_check=True, **config), ctx.cuda)
    except Exception as error:  # noqa: BLE001 - refused here (fp8 before Ada, or on a CPU): said
        return {"skipped": f"refused: {type(error).__name__}: {error}"[:300]}
    weights = ctx.torch.cuda.memory_allocated() / 1e9 if ctx.cuda else None
    fig, base = {"start s": start, "weights GB": weights}, lines.get(against, {})
    if config.get("attention_backend"):
        fig["attention"] = rt.speed["attention"]["backend"]
    for at, (fields, batch) in shapes(ctx, family).items():
        step = bench_step.step_s(rt, batch, name, max(2, ctx.args.repeats + 1), **fields, **held["extra"])
        fig[f"step ms, {at}"] = 1e3 * step
        fig[f"x eager, {at}"] = stats.ratio(lines["diffusers eager"][f"step ms, {at}"], 1e3 * step)
        if against:
            fig[f"x {against}, {at}"] = stats.ratio(base.get(f"step ms, {at}"), 1e3 * step)
        fig[f"MFU, {at}"] = mfu(ctx, rt, {**fields, **held["extra"]}, batch, step, config.get("quantization", "none"))
    if config.get("quantization"):
        fig["weights / unquantized"] = stats.ratio(fig["weights GB"], base.get("weights GB"))
    (outcome,) = in_process.run(rt, [held["probe"]])
    fig["PSNR dB vs eager"] = outcome.error or stats.psnr(outcome.images, held["reference"])
    return {**fig, **(judged(fig, TARGETS[name]) if name in TARGETS else {})}
