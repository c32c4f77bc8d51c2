"""``diffserve calibrate``: what one denoising step costs on this model and device, against its
cost in rows at the native size (:mod:`diffserve.wire.costs`), and the bounds that follow.

It runs the step engine itself on the loaded model: for each size and batch it admits that many
requests and times their steps (the forward, every request's scheduler step), after a warm-up.
A line ``seconds = fixed + per_unit x cost`` is fitted through the timings, and:

- ``--max-batch-cost`` is suggested where one forward reaches 90% of the throughput an endless
  batch would give (``cost = 9 x fixed / per_unit``): past it, a bigger forward only makes every
  request in it wait longer;
- on a GPU, the peak memory of each forward is measured too, and the forward bound is capped so
  that the largest forward fits the free memory with a margin; ``--max-running-cost`` is then set
  to fit the latents that many requests hold across sets in what is left.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

from diffserve.device.stats import DeviceStats

# Share of the free GPU memory a forward may use; the rest is headroom for fragmentation, the VAE
# decode and whatever else the process allocates.
MEMORY_MARGIN = 0.8
# A forward is "big enough" once it gives this share of the throughput of an endless batch.
THROUGHPUT_SHARE = 0.9


@dataclass
class Sample:
    width: int
    height: int
    image_count: int
    cost: float
    seconds: float
    peak_bytes: int | None = None


def fit(samples: list[Sample]) -> tuple[float, float]:
    """Least squares ``seconds = fixed + per_unit * cost``."""
    xs, ys = [s.cost for s in samples], [s.seconds for s in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    per_unit = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else my / mx
    return max(0.0, my - per_unit * mx), max(per_unit, 1e-12)


def suggest(samples: list[Sample], free_bytes: int | None, latent_bytes_per_unit: float) -> dict:
    """The bounds the timings (and, on a GPU, memory) suggest."""
    fixed, per_unit = fit(samples)
    batch = THROUGHPUT_SHARE / (1 - THROUGHPUT_SHARE) * fixed / per_unit
    out = {"fixed_s": fixed, "per_unit_s": per_unit, "max_batch_cost": round(max(batch, 1.0), 1)}
    measured = [s for s in samples if s.peak_bytes]
    if free_bytes and measured:
        per_unit_bytes = max(s.peak_bytes / s.cost for s in measured)
        out["peak_bytes_per_unit"] = per_unit_bytes
        out["max_batch_cost"] = round(max(1.0, min(out["max_batch_cost"],
                                                   MEMORY_MARGIN * free_bytes / per_unit_bytes)), 1)
        left = MEMORY_MARGIN * free_bytes - out["max_batch_cost"] * per_unit_bytes
        out["max_running_cost"] = round(max(out["max_batch_cost"],
                                            left / max(latent_bytes_per_unit, 1.0)), 1)
    else:
        out["max_running_cost"] = round(2 * out["max_batch_cost"], 1)
    return out


def measure(model: str, device: str, dtype: str, sides: list[float], batches: list[int],
            steps: int, threads: int) -> tuple[list[Sample], dict]:
    from diffserve.config.flags import ServerConfig
    from diffserve.wire.costs import image_cost, uses_cfg
    from diffserve.executor.families.known import UnsupportedMode
    from diffserve.executor.runtime import build_runtime
    from diffserve.wire.request import ImageRequest, WorkItem

    try:
        rt = build_runtime(ServerConfig(model=model, device=device, dtype=dtype,
                                        batching_mode="step"), torch_threads=threads)
    except UnsupportedMode as error:
        raise SystemExit(f"calibrate measures the step engine: {error}") from None
    loaded, info, engine = rt.loaded, rt.info, rt.step_engine()
    stats = DeviceStats(loaded.device)
    stride = info.spatial_stride
    samples, latent_bytes = [], []
    for side in sides:
        width = max(stride, round(info.width * side / stride) * stride)
        height = max(stride, round(info.height * side / stride) * stride)
        cfg = uses_cfg(info.guidance_rule, info.default_guidance_scale, "")
        per_image = image_cost(width, height, info.width, info.height, cfg)
        for count in batches:
            items = [WorkItem(ImageRequest(f"c{side}-{count}-{i}", info.name, width, height,
                                           num_inference_steps=steps + 1,
                                           guidance_scale=info.default_guidance_scale,
                                           prompt="calibration", seed=i, cost=per_image), 0, 1)
                     for i in range(count)]
            if engine.admit(items, [[] for _ in items]):
                raise SystemExit(f"could not admit {count} images of {width}x{height}")
            # What the requests hold between steps: their latents, in their own dtype (float32
            # for Wan, Z-Image and Sana whatever the weights'), per unit of cost.
            latent_bytes.append(sum(u.prepared.latents.nelement() * u.prepared.latents.element_size()
                                    for u in engine.units) / (count * per_image))
            engine.step()  # warm-up: first-use allocations
            base = stats.start()
            times = []
            for _ in range(steps - 1):
                start = time.perf_counter()
                engine.step()
                times.append(stats.done() - start)
            peak = stats.peak(base)
            engine.cancel([item.request.request_id for item in items])
            engine.step()
            samples.append(Sample(width, height, count, count * per_image,
                                  statistics.median(times), peak))
    facts = {"model": model, "pipeline": loaded.pipeline_class, "device": loaded.device,
             "dtype": loaded.dtype, "native": f"{info.width}x{info.height}",
             "native_image_cost": image_cost(1, 1, 1, 1, uses_cfg(info.guidance_rule,
                                                                   info.default_guidance_scale, "")),
             "free_bytes": stats.free(),
             "latent_bytes_per_unit": max(latent_bytes)}
    return samples, facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="diffserve calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shapes")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--torch-threads", type=int, default=0)
    p.add_argument("--sides", default="0.5,1,1.5", help="image sides as shares of the native side")
    p.add_argument("--batches", default="1,2,4,8", help="images per forward")
    p.add_argument("--steps", type=int, default=4, help="timed steps per point (after a warm-up)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be at least 2")
    sides = [float(v) for v in a.sides.split(",")]
    batches = [int(v) for v in a.batches.split(",")]
    samples, facts = measure(a.model, a.device, a.dtype, sides, batches, a.steps, a.torch_threads)
    bounds = suggest(samples, facts["free_bytes"], facts["latent_bytes_per_unit"])
    if a.json:
        print(json.dumps({"facts": facts, "samples": [s.__dict__ for s in samples],
                          "suggested": bounds}, indent=2))
        return 0
    print(f"{facts['model']} ({facts['pipeline']}) on {facts['device']}/{facts['dtype']}, native "
          f"{facts['native']}; a native image costs {facts['native_image_cost']:g} "
          "(rows: 2 with guidance)")
    print("| size | images | cost | step ms | ms per cost unit |" +
          (" peak MiB |" if samples[0].peak_bytes is not None else ""))
    print("| --- | --- | --- | --- | --- |" + (" --- |" if samples[0].peak_bytes is not None else ""))
    for s in samples:
        row = (f"| {s.width}x{s.height} | {s.image_count} | {s.cost:g} | {1000 * s.seconds:.1f} | "
               f"{1000 * s.seconds / s.cost:.2f} |")
        if s.peak_bytes is not None:
            row += f" {s.peak_bytes / 2**20:.0f} |"
        print(row)
    print(f"fit: step = {1000 * bounds['fixed_s']:.1f} ms + {1000 * bounds['per_unit_s']:.2f} ms "
          "x cost")
    if "peak_bytes_per_unit" in bounds:
        print(f"memory: {bounds['peak_bytes_per_unit'] / 2**20:.0f} MiB per cost unit at the peak "
              f"of a forward; {facts['free_bytes'] / 2**30:.1f} GiB free")
    print(f"suggested: --max-batch-cost {bounds['max_batch_cost']:g} --max-running-cost "
          f"{bounds['max_running_cost']:g}")
    return 0
