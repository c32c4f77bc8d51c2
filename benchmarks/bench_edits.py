"""Instruction edits batched per step: ``--count`` edits sent at once to a step-mode server
against the same edits one at a time, each image checked against the model's own pipeline
called alone with its fitted input (in this process).

    python benchmarks/bench_edits.py --model tiny-flux-kontext --count 8 --rounds 3
"""

from __future__ import annotations

import asyncio
import io
import sys
import time

import aiohttp
import numpy as np
from PIL import Image

from kit import in_process, loadgen, servers
from diffserve.work import ImageRequest

SPEED_UP = "speed-up, at once / one at a time"
EXPECTED: dict[int, np.ndarray] = {}  # edit i's image from the pipeline alone, made once


async def edit(client: aiohttp.ClientSession, url: str, image: np.ndarray, i: int, a) -> np.ndarray:
    png, form = io.BytesIO(), aiohttp.FormData({"prompt": f"edit number {i}", "seed": str(100 + i),
                                                "size": f"{a.side}x{a.side}", "num_inference_steps": str(a.steps)})
    Image.fromarray(image).save(png, format="PNG")
    form.add_field("image", png.getvalue(), filename="in.png", content_type="image/png")
    return await loadgen.image(client, url, None, "/v1/images/edits", data=form)


async def timed(url: str, a) -> tuple[float, float, list[np.ndarray], list[np.ndarray]]:
    """(one at a time s, at once s, the inputs, the images made at once) of ``--count`` edits, each of
    its own input (the tests' sample image, seeded), after a warm-up edit."""
    from diffserve.executor.checks.reference import sample_image

    images = [sample_image(a.side, seed=i)[0] for i in range(a.count)]
    async with loadgen.session() as client:
        await edit(client, url, images[0], 999, a)
        start = time.perf_counter()
        for i, image in enumerate(images):
            await edit(client, url, image, i, a)
        alone, start = time.perf_counter() - start, time.perf_counter()
        together = await asyncio.gather(*(edit(client, url, image, i, a) for i, image in enumerate(images)))
        return alone, time.perf_counter() - start, images, list(together)


def edits(b: servers.Bench) -> dict[str, float | None]:
    a = b.args
    with b.servers("edits", {"--batching-mode": "step", "--dynamic-batch-max-size": a.count}) as served:
        alone, at_once, images, made = asyncio.run(timed(served.urls[0], a))
    ref = in_process.reference(a.model, a.torch_threads)
    for i, image in enumerate(images):
        if i not in EXPECTED:
            EXPECTED[i] = ref.images(ImageRequest(
                "ref", a.model, a.side, a.side, task="edit", references=1, num_inference_steps=a.steps,
                guidance_scale=ref.loaded.defaults.get("guidance_scale", 4.0), prompt=f"edit number {i}",
                seed=100 + i), references=[image])[0]
    worst = max(ref.diff(m, EXPECTED[i]) for i, m in enumerate(made))
    b.failed |= worst > 2
    return {"one at a time s": alone, "at once s": at_once, SPEED_UP: alone / at_once, "worst pixel diff": worst}


def main(argv: list[str] | None = None) -> int:
    return servers.main(__doc__, {"edits": servers.Scenario(edits, [(SPEED_UP, ">=", 2.0)])}, argv,
                        model="tiny-flux-kontext", rounds=3, steps=4, count=8, side=64, torch_threads=0)


if __name__ == "__main__":
    sys.exit(main())
