"""``--only sizes``: rows of different sizes in one forward (docs/batching.md, "Sizes in one
forward") on the served model as the server builds it: a step's time with every size in one
running set, against the same rows a set per size (the sum of each size's step) and one row at
a time (the sum of each row's step alone, vllm-omni #4024's baseline), for the pairs #4024
measured (512²+512², 512²+256², 512²+1024²; its gains 1.19x, 1.23x, 1.01x the targets) and an
aspect-ratio mix (1024², 1024x1536, 1536x1024, 768²); with --tiny, each side an eighth."""

from __future__ import annotations

import bench_step
from gpu import IMAGES, judged, section
from kit import in_process

MIXES = {"512+512": [(512, 512), (512, 512)], "512+256": [(512, 512), (256, 256)],
         "512+1024": [(512, 512), (1024, 1024)],
         "aspect mix": [(1024, 1024), (1024, 1536), (1536, 1024), (768, 768)]}
TARGETS = [("512+512: alone / mixed", ">=", 1.19), ("512+256: alone / mixed", ">=", 1.23),
           ("512+1024: alone / mixed", ">=", 1.01)]


@section("sizes", families=IMAGES, cost=(240, 40))
def sizes(ctx, family: str) -> dict:
    rt, fig = ctx.runtime(family), {}
    scale = 8 if ctx.args.tiny else 1
    extra = {"negative_prompt": " "} if family == "qwen-image" else {}  # true CFG on
    repeats = max(2, ctx.args.repeats)
    fig["mixes sizes"] = rt.describe().mixed_sizes.get("generate")
    for name, mix in MIXES.items():
        sizes = [(w // scale, h // scale) for w, h in mix]

        def its(tag: str, chosen) -> list:
            return [item for i, (w, h) in enumerate(chosen) for item in in_process.items(
                rt, 1, f"{tag}-{i}", repeats + 2, first=i, width=w, height=h, **extra)]
        mixed = bench_step.step_s(rt, len(sizes), name, repeats, its=its(name, sizes))
        # A set per size: each distinct size's step, as often as the mix has it.
        apart = sum(bench_step.step_s(rt, sizes.count(size), f"{name} {size}", repeats,
                                      its=its(f"{name} {size}", [size] * sizes.count(size)))
                    for size in dict.fromkeys(sizes))
        alone = sum(bench_step.step_s(rt, 1, f"{name} {i}", repeats, its=its(f"{name} {i}", [size]))
                    for i, size in enumerate(sizes))
        fig.update({f"{name}: mixed step ms": 1e3 * mixed, f"{name}: apart step ms": 1e3 * apart,
                    f"{name}: alone step ms": 1e3 * alone, f"{name}: apart / mixed": apart / mixed,
                    f"{name}: alone / mixed": alone / mixed})
    return {**fig, **judged(fig, TARGETS)}
