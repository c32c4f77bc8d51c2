"""Micro-benchmark of per-row LoRA: one UNet forward with a different adapter stack per row.

For each batch size (rows of one UNet call; classifier-free guidance makes it twice the images)
and LoRA rank, k distinct adapters are spread over the rows (row i gets adapter i mod k) and the
forward is timed with RowAdapters' two methods (``loop``, ``gathered``) and, as a reference, PEFT's
own mixed-batch path (``adapter_names``, one adapter per row at its global scale). ``no LoRA`` is
the same UNet before any adapter was added. Adapters are random, on the attention projections
(to_q, to_k, to_v, to_out.0). Prints a markdown table of median milliseconds. The contenders of a
row run in turn, so drift hits them alike; on a shared machine a row during which other processes
took CPU is measured again (--busy-limit, --busy-retries), and the share they took is printed.

    python benchmarks/bench_lora_forward.py --model sd-mid --batch 8,16 --ranks 8,64 --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from functools import partial

import torch

ATTN = ["to_q", "to_k", "to_v", "to_out.0"]


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_ticks() -> tuple[int, int, int] | None:
    """(busy, total) CPU ticks of the machine and this process's own ticks; None off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks), int(own[11]) + int(own[12])


def others_share(before, after) -> float:
    """The machine's CPU share used by other processes between two cpu_ticks()."""
    if before is None or after is None or after[1] == before[1]:
        return 0.0
    return max(0, (after[0] - before[0]) - (after[2] - before[2])) / (after[1] - before[1])


def wait_until_idle(limit: float, patience_s: float) -> None:
    """Waits (up to ``patience_s``) for a second in which other processes use under ``limit``."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        before = cpu_ticks()
        time.sleep(1.0)
        if others_share(before, cpu_ticks()) < limit:
            return


def median_ms(fns: list, args) -> tuple[list[float], list[torch.Tensor], float]:
    """Median milliseconds of each of ``fns``, run in turn so that drift hits them alike, and the
    CPU share other processes took meanwhile. On a shared machine a run that others disturbed
    (share above --busy-limit) is repeated, up to --busy-retries times."""
    for attempt in range(args.busy_retries + 1):
        wait_until_idle(args.busy_limit, args.patience)
        before = cpu_ticks()
        outs, times = [None] * len(fns), [[] for _ in fns]
        for rep in range(args.warmup + args.repeats):
            for i, fn in enumerate(fns):
                start = time.perf_counter()
                outs[i] = fn()
                if rep >= args.warmup:
                    times[i].append(time.perf_counter() - start)
        busy = others_share(before, cpu_ticks())
        if busy < args.busy_limit:
            break
    return [statistics.median(t) * 1000 for t in times], outs, busy


@contextmanager
def peft_adapter_names(model, names: list[str]):
    """PEFT's mixed batch: each LoraLayer gets ``adapter_names`` (what PeftModel injects)."""
    from peft.tuners.lora import LoraLayer

    def inject(module, args, kwargs):
        return args, {**kwargs, "adapter_names": names}

    handles = [m.register_forward_pre_hook(inject, with_kwargs=True)
               for m in model.modules() if isinstance(m, LoraLayer)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="sd-mid", help="Embedded model with a UNet.")
    p.add_argument("--batch", default="8,16", help="Comma-separated rows per UNet call.")
    p.add_argument("--ranks", default="8,64", help="Comma-separated LoRA ranks.")
    p.add_argument("--adapters", default="1,2,4,8,16",
                   help="Comma-separated k (distinct adapters in a batch); k > batch is skipped.")
    p.add_argument("--methods", default="loop,gathered,peft",
                   help="Any of auto, loop, gathered (RowAdapters' methods) and peft.")
    p.add_argument("--repeats", type=int, default=5, help="Timed forwards per cell; the median counts.")
    p.add_argument("--warmup", type=int, default=1, help="Untimed forwards per cell.")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads.")
    p.add_argument("--busy-limit", type=float, default=0.05,
                   help="CPU share of other processes above which a cell is measured again.")
    p.add_argument("--busy-retries", type=int, default=3, help="Re-measurements of a disturbed cell.")
    p.add_argument("--patience", type=float, default=120, help="Seconds to wait for an idle machine.")
    args = p.parse_args(argv)

    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    from diffserve.executor.adapter_rows import RowAdapters
    from diffserve.models.embedded import embedded_path

    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    batches, ranks, ks = ints(args.batch), ints(args.ranks), ints(args.adapters)
    unet = UNet2DConditionModel.from_pretrained(embedded_path(args.model), subfolder="unet").eval()
    c = unet.config
    size = c.sample_size

    def inputs(n: int) -> dict:
        g = torch.Generator().manual_seed(0)
        return dict(sample=torch.randn(n, c.in_channels, size, size, generator=g),
                    timestep=torch.linspace(10, 900, n),
                    encoder_hidden_states=torch.randn(n, 77, c.cross_attention_dim, generator=g))

    def forward(model, kw):
        with torch.inference_mode():
            return model(**kw, return_dict=False)[0]

    plain = copy.deepcopy(unet)  # "no LoRA": the UNet before any adapter was added
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # one per adapter
    for r in ranks:
        for j in range(max(ks)):
            # init_lora_weights=False: random, non-zero B, so the deltas are real work.
            unet.add_adapter(LoraConfig(r=r, lora_alpha=r, target_modules=ATTN, init_lora_weights=False),
                             adapter_name=f"r{r}-{j}")
    reference = copy.deepcopy(unet)  # keeps PEFT's own application, for its adapter_names path
    rows = RowAdapters(unet)

    def with_rows(method, stacks, kw):
        rows.method = method
        with rows.rows(stacks):
            return forward(unet, kw)

    def with_peft(names, kw):
        with peft_adapter_names(reference, names):
            return forward(reference, kw)

    forward(plain, inputs(max(batches)))  # first-call costs (allocator, kernels) out of the figures
    print(f"{args.model} UNet, {cpu_name()}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}, ms per forward\n")
    print("| rows | rank | k | no LoRA | " + " | ".join(methods) + " | worst diff | others' CPU |")
    print("|---:|---:|---:|---:|" + "---:|" * len(methods) + "---:|---:|")
    for n in batches:
        kw = inputs(n)
        # k = 0: RowAdapters attached, every row base: the cost of the hooks alone.
        ms, _, busy = median_ms([partial(forward, plain, kw), partial(with_rows, "loop", [()] * n, kw)],
                                args)
        print(f"| {n} | - | 0 | {ms[0]:.1f} | " + " | ".join(
            "-" if m == "peft" else f"{ms[1]:.1f}" for m in methods) + f" | - | {busy:.0%} |", flush=True)
        for r in ranks:
            for k in (k for k in ks if k <= n):
                names = [f"r{r}-{i % k}" for i in range(n)]
                fns = [partial(forward, plain, kw)] + [
                    partial(with_peft, names, kw) if m == "peft"
                    else partial(with_rows, m, [[(name, 1.0)] for name in names], kw) for m in methods]
                ms, outs, busy = median_ms(fns, args)
                # The methods must agree: a fast wrong answer is no answer.
                diff = max(((o - outs[1]).abs().max() / outs[1].abs().max()).item() for o in outs[1:])
                print(f"| {n} | {r} | {k} | " + " | ".join(f"{v:.1f}" for v in ms)
                      + f" | {diff:.1e} | {busy:.0%} |", flush=True)
    print("\nno LoRA: the UNet before any adapter was added; k = 0: RowAdapters attached, every row "
          "base; worst diff: largest relative difference between the methods' outputs; others' CPU: "
          "the machine's CPU share other processes took while the row was measured.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
