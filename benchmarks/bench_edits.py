"""Instruction edits batched per step: ``--count`` edits sent at once to a step-mode server
against the same edits one at a time, each image checked against the model's own pipeline
called alone with its fitted input (in this process). One fresh server per round; the ratio of
the two wall times is taken within a round, and the median over ``--rounds`` is reported.

    python benchmarks/bench_edits.py --model tiny-flux-kontext --count 8 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the plain pipeline's reference call

from diffserve.launcher import ServerProcess  # noqa: E402


def inputs(count: int, side: int) -> list[np.ndarray]:
    """Different structured inputs: gradients and a block, shifted per edit."""
    ramp = np.linspace(0, 255, side, dtype=np.float32)
    base = np.stack([np.broadcast_to(ramp, (side, side)), np.broadcast_to(ramp[:, None], (side, side)),
                     np.full((side, side), 128.0)], axis=-1).astype(np.uint8)
    base[side // 4:3 * side // 4, side // 4:3 * side // 4] = (200, 40, 30)
    return [np.ascontiguousarray(np.roll(base, 5 * i, axis=1)) for i in range(count)]


def png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


async def edit(client: httpx.AsyncClient, url: str, image: np.ndarray, i: int, steps: int,
               size: str) -> np.ndarray:
    r = await client.post(f"{url}/v1/images/edits", files={"image": ("in.png", png(image), "image/png")},
                          data={"prompt": f"edit number {i}", "seed": str(100 + i), "size": size,
                                "num_inference_steps": str(steps)})
    r.raise_for_status()
    data = base64.b64decode(r.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


async def one_round(url: str, images: list[np.ndarray], steps: int, size: str) -> dict:
    async with httpx.AsyncClient(timeout=3600) as client:
        await edit(client, url, images[0], 999, steps, size)  # warm-up
        start = time.perf_counter()
        for i, image in enumerate(images):
            await edit(client, url, image, i, steps, size)
        alone = time.perf_counter() - start
        start = time.perf_counter()
        together = await asyncio.gather(*(edit(client, url, image, i, steps, size)
                                          for i, image in enumerate(images)))
        at_once = time.perf_counter() - start
    return {"one_at_a_time_s": alone, "at_once_s": at_once, "ratio": alone / at_once,
            "images": together}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-flux-kontext")
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--side", type=int, default=64)
    p.add_argument("--torch-threads", type=int, default=0)
    p.add_argument("--output-file", type=Path)
    a = p.parse_args(argv)
    size = f"{a.side}x{a.side}"
    images = inputs(a.count, a.side)
    rounds = []
    for r in range(a.rounds):
        log = Path(tempfile.mkdtemp(prefix="bench-edits-")) / "server.log"
        server = ServerProcess.diffserve(
            "--model", a.model, "--batching-mode", "step", "--dynamic-batch-max-size", str(a.count),
            "--torch-threads", str(a.torch_threads), "--log-level", "warning", log_path=log,
            startup_timeout_s=900)
        with server:
            rounds.append(asyncio.run(one_round(server.url, images, a.steps, size)))
        print(f"round {r + 1}: one at a time {rounds[-1]['one_at_a_time_s']:.2f} s, at once "
              f"{rounds[-1]['at_once_s']:.2f} s, x{rounds[-1]['ratio']:.2f}", flush=True)
    from diffserve.executor.loading import load_model
    from helpers import make_request
    from reference import max_diff, solo

    loaded = load_model(a.model, torch_threads=a.torch_threads)
    worst = 0
    for i, image in enumerate(images):
        request = make_request(model=a.model, task="edit", prompt=f"edit number {i}", seed=100 + i,
                               steps=a.steps, width=a.side, height=a.side, references=1,
                               guidance=loaded.defaults.get("guidance_scale", 4.0))
        expected = solo(loaded, {}, request, references=[image])[0]
        worst = max(worst, *(max_diff(r["images"][i], expected) for r in rounds))
    report = {"model": a.model, "count": a.count, "steps": a.steps, "size": size,
              "ratio_median": statistics.median(r["ratio"] for r in rounds),
              "rounds": [{k: v for k, v in r.items() if k != "images"} for r in rounds],
              "worst_pixel_diff": worst}
    print(f"{a.model}: {a.count} edits at once / one at a time: x{report['ratio_median']:.2f} "
          f"(median of {a.rounds}); worst pixel difference from the pipeline alone: {worst}/255")
    if a.output_file:
        a.output_file.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if worst <= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
