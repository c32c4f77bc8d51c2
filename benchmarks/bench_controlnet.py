"""ControlNet batched per step: ``--count`` generations sent at once to a step-mode server serving
two control models, against the same generations one at a time. The requests mix the two models,
stacks of both, several scales and windows, and requests without control; each image made at once
is checked against the same request made alone (within 2/255).

Images per denoiser forward come from the server's ``diffserve_step_running_images`` histogram
(sum over count of its change over the burst): one observation per denoiser forward, of the images
it carried. ``diffserve_forward_cost`` counts rows at the native size with the control models' cost
added (not images), and ``diffserve_steps`` only counts the forwards.

A control model's cost counts against the server's --max-batch-cost: its parameters over the
UNet's, per row (tiny-sd's control models: 0.54 each, SD 1.5's: 0.42). At the server's default
(room for --dynamic-batch-max-size plain images, the default here) an image with one control takes
1.5 times a plain image's room, with two 2.1 times; --max-batch-cost raises the room.

    python benchmarks/bench_controlnet.py --model tiny-sd --count 8 --rounds 3
"""

from __future__ import annotations

import asyncio
import base64
import io
import sys
import time

import numpy as np
from PIL import Image

from kit import loadgen, server_metrics, servers
from kit.cli import prompts

SPEED_UP = "speed-up, at once / one at a time"
PER_FORWARD = "images per forward, at once"
WORST = "worst pixel diff"
CONTROLNETS = {"edges": "tiny-sd-control", "depth": "tiny-sd-control-b"}
# Request i's controls: STACKS[i % 8]. Both models alone and stacked, scales, windows, and none.
STACKS = [
    [{"model": "edges", "scale": 1.0}],
    [],
    [{"model": "depth", "scale": 0.7, "start": 0.25, "end": 0.75}],
    [{"model": "edges", "scale": 0.5}, {"model": "depth", "scale": 0.8}],
    [{"model": "depth", "scale": 1.3}],
    [],
    [{"model": "edges", "scale": 0.9, "end": 0.5}, {"model": "depth", "scale": 0.6, "start": 0.5}],
    [{"model": "edges", "scale": 1.2, "start": 0.25}],
]


def png_b64(pixels: np.ndarray) -> str:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def control_image(name: str, i: int, side: int = 64) -> str:
    """Request i's image for control ``name``: a rectangle's outline (edges) or a gradient (depth),
    each request its own. The server resizes it to the request's size."""
    if name == "edges":
        image, lo, hi = np.zeros((side, side, 3), np.uint8), 4 + i % 8, side - 12 + i % 8
        image[lo:hi, [lo, hi - 1]] = image[[lo, hi - 1], lo:hi] = 255
        return png_b64(image)
    ramp = np.linspace(0, 255, side, dtype=np.uint8)
    ramp = ramp[::-1] if i % 2 else ramp
    return png_b64(np.broadcast_to(ramp[:, None, None] if i % 4 >= 2 else ramp[None, :, None], (side, side, 3)).copy())


def bodies(a) -> list[dict]:
    texts = prompts()
    return [{"prompt": texts[i % len(texts)], "seed": 100 + i, "num_inference_steps": a.steps,
             **({"size": a.size} if a.size else {}),
             "controls": [{**c, "image": control_image(c["model"], i)} for c in STACKS[i % len(STACKS)]]}
            for i in range(a.count)]


def forwards(url: str, before: server_metrics.Samples, images: int) -> tuple[float, float]:
    """(images carried, denoiser forwards) since ``before``. The executor counts a step after the
    step, which may be after its last answer went out: wait until every image's steps are in."""
    for _ in range(100):
        after = server_metrics.metrics(url)
        carried = server_metrics.change(before, after, "diffserve_step_running_images_sum") or 0.0
        if carried >= images:
            break
        time.sleep(0.05)
    return carried, server_metrics.change(before, after, "diffserve_step_running_images_count") or 0.0


async def timed(url: str, a) -> dict[str, float]:
    """A warm-up (both models stacked), the requests one at a time, then all at once: the times,
    images per forward at once, and the worst difference of an image made at once from the same
    request's image made alone."""
    requests = bodies(a)
    async with loadgen.session() as client:
        await loadgen.image(client, url, {**requests[0], "seed": 999, "controls": [
            {**c, "image": control_image(c["model"], 0)} for c in STACKS[3]]})
        start = time.perf_counter()
        alone = [await loadgen.image(client, url, body) for body in requests]
        one_at_a_time, before = time.perf_counter() - start, server_metrics.metrics(url)
        start = time.perf_counter()
        together = await asyncio.gather(*(loadgen.image(client, url, body) for body in requests))
        at_once = time.perf_counter() - start
    carried, n = forwards(url, before, a.count * a.steps)
    worst = max(int(np.abs(x.astype(int) - y.astype(int)).max()) for x, y in zip(alone, together))
    return {"one at a time s": one_at_a_time, "at once s": at_once, SPEED_UP: one_at_a_time / at_once,
            PER_FORWARD: carried / n if n else None, "denoiser forwards at once": n, WORST: worst}


def controlnet(b: servers.Bench) -> dict[str, float | None]:
    a = b.args
    flags = {"--batching-mode": "step", "--dynamic-batch-max-size": a.count, "--max-batch-cost": a.max_batch_cost,
             "--controlnet": [f"{name}={path}" for name, path in CONTROLNETS.items()]}
    with b.servers("controlnet", flags) as served:
        figures = asyncio.run(timed(served.urls[0], a))
    b.failed |= figures[WORST] > 2
    print(f"[controlnet] one at a time {figures['one at a time s']:.2f} s, at once {figures['at once s']:.2f} s, "
          f"{figures[PER_FORWARD] or 0:.2f} images/forward, worst diff {figures[WORST]}", flush=True)
    return figures


def arguments(p) -> None:
    p.add_argument("--max-batch-cost", type=float, default=0.0,
                   help="The server's --max-batch-cost, in rows at the native size (0: the server's default). "
                        "tiny-sd: an image is 2 rows (guidance), each control model adds 0.54 per row.")


def main(argv: list[str] | None = None) -> int:
    targets = [(PER_FORWARD, ">=", 4.0), (SPEED_UP, ">=", 2.0), (WORST, "<=", 2)]
    return servers.main(__doc__, {"controlnet": servers.Scenario(controlnet, targets)}, argv, arguments,
                        model="tiny-sd", rounds=3, steps=8, size=None, count=8, torch_threads=0)


if __name__ == "__main__":
    sys.exit(main())
