"""``--only speed``: how close a step runs to the GPU's peak. Plain diffusers, eager, in the
served dtype (the pipeline's own call: the baseline, the same run and GPU, the same prompts), then
diffserve's step engine as it serves by default and with each of: the attention backend ``auto``
chooses, ``--compile``, ``--quantization fp8``, ``--quantization fp8-weight-only``, and the
first three together; at batch 1 and ``--batch``. Each: its start (the start-up compile included), the median step
(bench_step.py's; diffserve: its step timer's CUDA events; diffusers: the difference of two
calls that differ only in their step count, so encoding and decoding cancel), the speed-up over
eager diffusers, the model FLOPs utilisation (diffserve.executor.accel.flops) and the PSNR of one
image against eager diffusers' (same request, same seed). Qwen-Image runs with true CFG (a
negative prompt): two rows an image."""

from __future__ import annotations

import statistics

import bench_step
from gpu import IMAGES, section
from kit import in_process, stats

CONFIGS = {"diffserve": {}, "attention auto": {"attention_backend": "auto"},
           "compile": {"compile": True}, "fp8": {"quantization": "fp8"},
           "fp8 weight-only": {"quantization": "fp8-weight-only"},
           "all": {"attention_backend": "auto", "compile": True, "quantization": "fp8"}}


def extra_of(family: str) -> dict:
    """The requests' fields beyond the run's size: a negative prompt where it turns true CFG on."""
    return {"negative_prompt": " "} if family == "qwen-image" else {}


def plain_step_s(ctx, rt, family: str, batch: int, steps: int) -> float:
    """One step of the pipeline's own call at ``batch``: (a call of ``2 + steps`` steps less one
    of 2) / ``steps``, latents out (no decode), median of --repeats."""
    torch, info, fields = ctx.torch, rt.info, {**ctx.fields[family], **extra_of(family)}
    pipe, guidance = rt.loaded.pipe, rt.family.guidance_kwarg

    def call(n: int) -> float:
        kwargs = {"prompt": ["a photograph of a red fox in the snow"] * batch, "num_inference_steps": n,
                  "width": fields["width"], "height": fields["height"], guidance: info.default_guidance_scale,
                  "generator": [torch.Generator(rt.loaded.device).manual_seed(i) for i in range(batch)],
                  "output_type": "latent", **rt.loaded.call_kwargs}
        if "negative_prompt" in fields:
            kwargs["negative_prompt"] = [fields["negative_prompt"]] * batch
        if "num_frames" in fields:
            kwargs["num_frames"] = fields["num_frames"]
        return ctx.timed(lambda: pipe(**kwargs))

    call(2)  # untimed: the first call of every kernel
    runs = [(call(2 + steps) - call(2)) / steps for _ in range(max(1, ctx.args.repeats))]
    return statistics.median(runs)


def mfu(ctx, rt, family: str, batch: int, seconds: float, quantization: str = "none") -> float | None:
    from diffserve.executor.accel import flops

    if rt.flops is None or not seconds:
        return None
    fields = {**ctx.fields[family], **extra_of(family)}  # the negative prompt counts its rows
    step = flops.step_flops(rt.flops, rt.info, batch, fields["width"], fields["height"],
                            fields.get("num_frames", 0), fields.get("guidance_scale"),
                            fields.get("negative_prompt", ""))
    peak = flops.peak_flops(rt.loaded.device, rt.loaded.dtype, quantization, ctx.args.peak_tflops)
    return step / seconds / peak if peak else None


@section("speed", families=(*IMAGES, "wan"))
def speed(ctx, family: str) -> dict:
    from diffserve.executor.checks.reference import solo

    batches, steps, fig = sorted({1, ctx.args.batch}), max(2, ctx.args.steps), {}
    extra = extra_of(family)
    eager = ctx.runtime(family, skip_startup_check=True)
    fig["dtype"] = eager.loaded.dtype
    for batch in batches:
        fig[f"diffusers eager: step ms, batch {batch}"] = base = 1e3 * plain_step_s(ctx, eager, family, batch, steps)
        fig[f"diffusers eager: MFU, batch {batch}"] = mfu(ctx, eager, family, batch, base / 1e3)
    (probe,) = ctx.items(eager, family, 1, "speed-psnr", steps, **extra)
    reference = solo(eager.loaded, eager.pipelines, probe.request)
    del eager
    ctx.free()
    for name, config in CONFIGS.items():
        try:  # its start: the start-up compile included
            fig[f"{name}: start s"], rt = in_process.timed(
                lambda c=config: ctx.runtime(family, skip_startup_check=True, **c), ctx.cuda)
        except Exception as error:  # noqa: BLE001 - refused here (fp8 before Ada): said, the rest runs
            fig[f"{name}: refused"] = f"{type(error).__name__}: {error}"[:200]
            continue
        if config.get("attention_backend"):
            fig[f"{name}: attention"] = rt.speed["attention"]["backend"]
        try:
            measure(ctx, rt, family, name, config, batches, extra, probe, reference, fig)
        except Exception as error:  # noqa: BLE001 - said, and the next configuration runs
            fig[f"{name}: failed"] = f"{type(error).__name__}: {error}"[:200]
        del rt
        ctx.free()
    return fig


def measure(ctx, rt, family, name, config, batches, extra, probe, reference, fig) -> None:
    """``name``'s step at each batch against eager diffusers', its MFU, and its image's PSNR."""
    for batch in batches:
        step = bench_step.median_step(rt, batch, name, max(2, ctx.args.repeats + 1),
                                      **ctx.fields[family], **extra)
        base = fig[f"diffusers eager: step ms, batch {batch}"]
        fig[f"{name}: step ms, batch {batch}"] = 1e3 * step
        fig[f"{name}: x eager, batch {batch}"] = base / (1e3 * step)
        fig[f"{name}: MFU, batch {batch}"] = mfu(ctx, rt, family, batch, step, config.get("quantization", "none"))
    (outcome,) = in_process.run(rt, [probe])
    fig[f"{name}: PSNR dB vs eager"] = stats.psnr(outcome.images, reference) if not outcome.error else outcome.error
