"""One denoiser forward on 1 rank against G (Ulysses), the bytes each collective moves, and the
speed-up on G H100s modelled for real-size FLUX.1-dev, Qwen-Image and Wan 2.1 14B: FLOPs from
the shapes, time = FLOPs / (G x ``--tflops``) + bytes a rank sends / ``--link-gbs``, no overlap.

    python benchmarks/bench_parallel.py --model tiny-flux --ranks 2 --size 256x256 --batch 2
    python benchmarks/bench_parallel.py --model random:flux.1-dev --ranks 8 --size 1024x1024   # 8 GPUs
    python benchmarks/bench_parallel.py --model none     # the modelled table alone
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import sys
import time
import traceback
from queue import Empty
from types import SimpleNamespace

from kit import cli, in_process, stats
from diffserve.executor.families.known import published_dtype
from diffserve.executor.model.loading import leave_out_unused_libraries, load_model
from diffserve.executor.parallel.model import parallelize
from diffserve.executor.parallel.topology import Group, RankSpec
from diffserve.executor.pipeline import pipeline_class_of
from diffserve.config.executors import Degrees
from diffserve.processes import bound_openmp_spin
from diffserve.serving.launcher import free_port
from diffserve.builders.registry import resolve_model

# name: blocks, hidden, heads, MLP width, image (video) tokens, text tokens, joint (the text in
# the self-attention's sequence), output channels per token; classifier-free guidance.
REAL = {"FLUX.1-dev 1024²": (19 + 38, 3072, 24, 12288, 4096, 512, True, 64, False),
        "Qwen-Image 1024²": (60, 3072, 24, 12288, 4096, 256, True, 64, True),
        "Wan 2.1 14B 720p x 81": (40, 5120, 40, 13824, 21 * 45 * 80, 512, False, 64, True)}


def model(blocks, d, heads, ffn, img, txt, joint, out, rows=1, g=1, element=2) -> dict:
    """FLOPs of ``rows`` rows' forward; bytes a rank of ``g`` hands its all-to-alls (q, k, v, the
    output back; heads padded to a multiple of ``g``) and sends of them; the output's bytes; the
    collectives (per attention 4 all-to-alls, each after an all-gather of the ranks' lengths)."""
    seq = img + txt if joint else img
    macs = (seq * (4 * d * d + 2 * d * ffn) + 2 * seq * seq * d if joint else  # an MM-DiT block
            img * (6 * d * d + 2 * d * ffn) + 2 * txt * d * d + 2 * img * (img + txt) * d)  # Wan's
    a2a = blocks * 4 * rows * seq * d * element * (-(-heads // g) * g) // heads // g if g > 1 else 0
    return {"flops": 2 * macs * blocks * rows, "a2a_bytes": a2a, "a2a_sent": a2a * (g - 1) // g,
            "out_bytes": rows * img * out * element, "calls": 8 * blocks + 2 if g > 1 else 0}


def modelled(tflops: float, link_gbs: float) -> list[dict]:
    """Per model and plan: a denoising step (both guidance branches where the model has them)."""
    rows, rate, link = [], tflops * 1e12, link_gbs * 1e9
    for name, (*shape, guided) in REAL.items():
        branches = 2 if guided else 1
        one = branches * model(*shape)["flops"] / rate
        for cfg, g in [(1, 2), (1, 4), (1, 8)] + ([(2, 1), (2, 4)] if guided else []):
            m = model(*shape, rows=branches // cfg, g=g)  # one rank's forward
            sent = m["a2a_sent"] + m["out_bytes"] * (g - 1) // g + m["out_bytes"] * (cfg > 1)
            compute, comm = m["flops"] / g / rate, sent / link
            rows.append({"model": name, "plan": " x ".join([f"CFG-{cfg}"] * (cfg > 1) + [f"Ulysses-{g}"] * (g > 1)),
                         "GPUs": cfg * g, "TFLOP/step": one * rate / 1e12, "GB sent/rank": sent / 1e9,
                         "collectives": m["calls"] + (cfg > 1), "compute ms": 1e3 * compute, "comm ms": 1e3 * comm,
                         "1 GPU ms": 1e3 * one, "speed-up": one / (compute + comm)})
    return rows


def count_collectives(world: int) -> dict:
    """The collectives diffusers and diffserve call, wrapped: op -> {calls, bytes (the input's),
    sent (to the other ranks)} as they run."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    seen: dict = {}
    for module, name, index in ((funcol, "all_to_all_single", 0), (funcol, "all_gather_tensor", 0),
                                (dist, "all_gather", 1), (dist, "all_reduce", 0), (dist, "all_to_all_single", 1)):
        def counted(*args, original=getattr(module, name), name=name, index=index, **kwargs):
            size, entry = args[index].nbytes, seen.setdefault(name, {"calls": 0, "bytes": 0, "sent": 0})
            entry["calls"], entry["bytes"] = entry["calls"] + 1, entry["bytes"] + size
            entry["sent"] += size - size // world if "to_all" in name else size * (world - 1)
            return original(*args, **kwargs)
        setattr(module, name, counted)
    return seen


def capture(loaded, width: int, height: int, batch: int, g: int, frames: int | None = None):
    """The denoiser, its first call's (args, kwargs) at this size (a video model's: ``frames``, by
    default the model's), and :func:`model` of its shapes."""
    import torch

    pipe, box = loaded.pipe, {}
    denoiser = getattr(pipe, "transformer", None) or pipe.unet

    def hook(module, args, kwargs):
        box.update(args=args, kwargs=kwargs)
        raise StopIteration  # the pipeline goes no further
    handle = denoiser.register_forward_pre_hook(hook, with_kwargs=True)
    video = {"num_frames": frames or loaded.defaults["num_frames"]} if "num_frames" in loaded.defaults else {}
    try:
        with torch.inference_mode(), contextlib.suppress(StopIteration):
            pipe(prompt=cli.prompts()[:1] * batch, width=width, height=height, num_inference_steps=2,
                 output_type="latent", generator=torch.Generator("cpu").manual_seed(0), **loaded.call_kwargs, **video)
    finally:
        handle.remove()
    c, kw = denoiser.config, box["kwargs"]
    x, d, text = kw["hidden_states"], c.num_attention_heads * c.attention_head_dim, kw["encoder_hidden_states"].shape[1]
    shape = ((c.num_layers, d, c.num_attention_heads, c.ffn_dim, x[0, 0].numel() // 4, text, False, 0) if x.dim() == 5
             else (c.num_layers + c.get("num_single_layers", 0), d, c.num_attention_heads, 4 * d, x.shape[1], text,
                   True, 0))  # Wan: (B, C, F, H, W) latents in 1x2x2 patches; the others: (B, tokens, C)
    return denoiser, box["args"], kw, model(*shape, rows=x.shape[0], g=g, element=denoiser.dtype.itemsize)


def timed(torch, denoiser, args, kwargs, n: int, barrier=lambda: None) -> tuple[list, object]:
    times = []
    with torch.inference_mode():
        for _ in range(n):
            barrier()
            seconds, out = in_process.timed(lambda: denoiser(*args, **kwargs), torch.cuda.is_available())
            times.append(seconds)
    return times, (out[0] if isinstance(out, tuple) else out.sample).float().cpu().numpy()


def rank_main(rank: int, world: int, port: int, build, args, queue) -> None:
    group, result = None, {}
    try:
        bound_openmp_spin()  # as a rank does, with no PEFT or torchao either
        leave_out_unused_libraries(False, "none")
        import torch

        device = f"cuda:{rank}" if torch.cuda.is_available() else "cpu"
        if device != "cpu":
            torch.cuda.set_device(rank)
        threads = max(1, args.torch_threads or (os.cpu_count() or 1) // world)
        group = Group(RankSpec(0, rank, Degrees(ulysses=world), (device,) * world, port, args.timeout))
        loaded = build(device=device, torch_threads=threads * world)
        denoiser, a, kw, predicted = capture(loaded, *args.wh, args.batch, world, args.frames)
        group.dist.barrier()  # every rank loaded: rank 0 has the machine, the others wait
        if rank == 0:
            times, result["out_1"] = timed(torch, denoiser, a, kw, args.warmup + args.repeats)
            result["times_1"] = times[args.warmup:]
        group.dist.barrier()
        torch.set_num_threads(threads)
        parallelize(loaded.pipe, SimpleNamespace(denoisers=[denoiser]), group)
        timed(torch, denoiser, a, kw, args.warmup, group.dist.barrier)
        seen = count_collectives(world)
        result["times_g"], result["out_g"] = timed(torch, denoiser, a, kw, args.repeats, group.dist.barrier)
        result.update(collectives={k: {f: v / args.repeats for f, v in e.items()} for k, e in seen.items()},
                      predicted=predicted, device=device, threads={"1 rank": threads * world, "per rank": threads})
    except BaseException:  # noqa: BLE001 - the parent reports it
        result = {"error": traceback.format_exc()[-3000:]}
    finally:
        queue.put((rank, result))
        if group is not None:
            group.close()


def loader(model: str):
    """A rank's ``build``: ``model`` loaded as an executor loads it, in the dtype diffserve picks for
    it on the rank's device (a random-weight architecture built there, ``random:NAME[:tiny]``)."""
    published = published_dtype(pipeline_class_of(resolve_model(model)))
    return functools.partial(load_model, model, published_dtype=published)


def measure(build, args) -> dict:
    """The figures of ``build(device=, torch_threads=) -> LoadedModel`` (picklable, e.g. :func:`loader`)
    on the ranks."""
    ctx, port = multiprocessing.get_context("spawn"), free_port()
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, build, args, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    ranks, deadline = {}, time.monotonic() + args.timeout
    try:
        while len(ranks) < len(procs):
            try:
                ranks.update([queue.get(timeout=1)])
            except Empty:  # a rank that died without a word, or the time is up
                if time.monotonic() > deadline or any(not p.is_alive() and r not in ranks for r, p in enumerate(procs)):
                    raise RuntimeError(f"no result from rank(s) {set(range(len(procs))) - set(ranks)}") from None
    finally:
        for p in procs:
            p.join(60)
            p.kill()
    if errors := [r["error"] for r in ranks.values() if "error" in r]:
        raise RuntimeError(f"a rank failed:\n{errors[0]}")
    r = ranks[0]
    t1, tg = stats.median(r.pop("times_1")), stats.median(r.pop("times_g"))
    a2a = {f: sum(e[f] for k, e in r["collectives"].items() if "to_all" in k) for f in ("bytes", "sent")}
    return {"figures": {"forward ms, 1 rank": 1e3 * t1, f"forward ms, {args.ranks} ranks": 1e3 * tg,
                        "speed-up": t1 / tg, "max abs diff": float(abs(r.pop("out_1") - r.pop("out_g")).max()),
                        "all-to-all bytes/forward": a2a["bytes"], "all-to-all bytes sent/forward": a2a["sent"],
                        "all-to-all bytes/forward, modelled": r["predicted"]["a2a_bytes"],
                        "collective calls/forward": sum(e["calls"] for e in r["collectives"].values()),
                        "collective calls/forward, modelled": r.pop("predicted")["calls"]}, **r}


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, model="tiny-flux", size="256x256", repeats=5, warmup=1, torch_threads=0, output_file=None)
    p.add_argument("--ranks", type=cli.count, default=2, help="G, the Ulysses degree measured.")
    p.add_argument("--batch", type=cli.count, default=1, help="Rows (images) of the forward.")
    p.add_argument("--frames", type=cli.count, default=None, help="A video model's frames (None: the model's).")
    p.add_argument("--tflops", type=float, default=400.0, help="A GPU's effective bf16 TFLOP/s (the model).")
    p.add_argument("--link-gbs", type=float, default=900.0, help="GB/s a GPU sends at (NVLink 4: 900).")
    p.add_argument("--timeout", type=float, default=600.0, help="Longest wait for the ranks, s.")
    args = p.parse_args(argv)
    args.wh, result = tuple(int(v) for v in args.size.lower().split("x")), {"figures": {}}
    if args.model != "none":
        result = measure(loader(args.model), args)
        print(f"{args.model} {args.size}, {args.batch} row(s), on {result['device']}: {result['collectives']}")
    result["modelled"] = modelled(args.tflops, args.link_gbs)
    print(f"\nModelled: a denoising step on H100s, {args.tflops:g} TFLOP/s bf16 each, {args.link_gbs:g} GB/s, "
          f"no overlap\n\n{stats.table(result['modelled'])}")
    cli.report("parallel", [result], args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
