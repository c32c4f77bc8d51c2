"""Reading an image of the shapes dataset back: which colours, which shape.

``classify`` snaps every pixel to the nearest palette colour, takes the most common colour of
the border pixels as the background and the pixels of any other colour as the foreground; the
foreground's colour is its most common one. The shape comes from the largest connected blob of
foreground: its fill ratio of its bounding box (square ~1, circle ~0.8, triangle ~0.5) and how
narrow its top rows are compared with its bottom rows (a triangle comes to a point).

Run ``python -m tools.shapes.evaluate --model DIR`` to score a saved pipeline on
the held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter, deque
from pathlib import Path

import numpy as np

from tools.shapes.data import COLOURS, PALETTE, SHAPES, held_out_prompts

_PALETTE_ARRAY = np.array([PALETTE[c] for c in COLOURS], dtype=np.float32)
_PROMPT = re.compile(r"^\s*an?\s+(\w+)\s+(\w+)\s+on\s+an?\s+(\w+)\s+background\s*\.?\s*$", re.I)


def parse_prompt(prompt: str) -> tuple[str, str, str]:
    """``"a red circle on a blue background"`` -> ``("red", "circle", "blue")``."""
    match = _PROMPT.match(prompt)
    if not match:
        raise ValueError(f"not a shapes prompt: {prompt!r}")
    fg, shape, bg = (g.lower() for g in match.groups())
    if fg not in PALETTE or bg not in PALETTE or shape not in SHAPES:
        raise ValueError(f"unknown colour or shape in {prompt!r}")
    return fg, shape, bg


def snap(image: np.ndarray) -> np.ndarray:
    """Index into COLOURS of the nearest palette colour for every pixel: int (H, W)."""
    pixels = image[..., :3].astype(np.float32)
    dist = ((pixels[..., None, :] - _PALETTE_ARRAY) ** 2).sum(-1)
    return dist.argmin(-1)


def _largest_blob(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of a boolean mask."""
    height, width = mask.shape
    seen = np.zeros_like(mask, dtype=bool)
    best: list[tuple[int, int]] = []
    for start in zip(*np.nonzero(mask)):
        if seen[start]:
            continue
        seen[start] = True
        blob, queue = [], deque([start])
        while queue:
            y, x = queue.popleft()
            blob.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        if len(blob) > len(best):
            best = blob
    out = np.zeros_like(mask, dtype=bool)
    if best:
        ys, xs = zip(*best)
        out[list(ys), list(xs)] = True
    return out


def shape_features(mask: np.ndarray) -> tuple[float, float]:
    """(fill ratio of the bounding box, top width / bottom width) of a boolean mask, where the
    top and bottom widths are the mean row widths over the top and bottom quarter of the box."""
    ys, xs = np.nonzero(mask)
    if len(ys) == 0:
        return 0.0, 0.0
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    box = mask[y0:y1, x0:x1]
    fill = float(box.mean())
    rows = box.sum(1).astype(np.float32)
    band = max(1, len(rows) // 4)
    top, bottom = rows[:band].mean(), rows[-band:].mean()
    return fill, float(top / max(bottom, 1.0))


def shape_from_features(fill: float, taper: float) -> str:
    if taper < 0.5 or fill < 0.62:
        return "triangle"
    return "square" if fill > 0.9 else "circle"


def classify(image: np.ndarray) -> tuple[str, str, str]:
    """(foreground colour, background colour, shape) of a uint8 (H, W, 3) image."""
    labels = snap(image)
    border = np.concatenate([labels[0], labels[-1], labels[1:-1, 0], labels[1:-1, -1]])
    bg = Counter(border.tolist()).most_common(1)[0][0]
    foreground = labels != bg
    if not foreground.any():
        return "none", COLOURS[bg], "none"
    blob = _largest_blob(foreground)
    fg = Counter(labels[blob].tolist()).most_common(1)[0][0]
    return COLOURS[fg], COLOURS[bg], shape_from_features(*shape_features(blob))


def generate(pipe, prompts: list[str], seed: int = 0, batch_size: int = 16,
             num_inference_steps: int = 20, guidance_scale: float = 4.0,
             width: int | None = None, height: int | None = None) -> np.ndarray:
    """uint8 (N, H, W, 3) images, image ``i`` drawn with generator seed ``seed + i`` (the same
    whatever the batch size)."""
    import torch

    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        generators = [torch.Generator("cpu").manual_seed(seed + start + i) for i in range(len(chunk))]
        with torch.inference_mode():
            images = pipe(prompt=chunk, generator=generators, num_inference_steps=num_inference_steps,
                          guidance_scale=guidance_scale, width=width, height=height,
                          output_type="np").images
        out.append((np.clip(np.asarray(images), 0.0, 1.0) * 255.0).round().astype(np.uint8))
    return np.concatenate(out)


def score_images(images: np.ndarray, prompts: list[str]) -> dict:
    """Accuracies of images against the prompts they were drawn for."""
    fg_ok = bg_ok = shape_ok = all_ok = 0
    per_shape: dict[str, list[int]] = {s: [0, 0] for s in SHAPES}
    predictions = []
    for image, prompt in zip(images, prompts):
        want_fg, want_shape, want_bg = parse_prompt(prompt)
        fg, bg, shape = classify(image)
        predictions.append((fg, shape, bg))
        fg_ok += fg == want_fg
        bg_ok += bg == want_bg
        shape_ok += shape == want_shape
        all_ok += (fg, shape, bg) == (want_fg, want_shape, want_bg)
        per_shape[want_shape][0] += shape == want_shape
        per_shape[want_shape][1] += 1
    n = max(len(prompts), 1)
    return {
        "n": len(prompts),
        "fg_accuracy": fg_ok / n,
        "bg_accuracy": bg_ok / n,
        "colour_accuracy": (fg_ok + bg_ok) / (2 * n),
        "shape_accuracy": shape_ok / n,
        "all_accuracy": all_ok / n,
        "shape_accuracy_by_shape": {s: (ok / total if total else None)
                                    for s, (ok, total) in per_shape.items()},
        "predictions": predictions,
    }


def score(pipe, prompts: list[str], seed: int = 0, batch_size: int = 16,
          num_inference_steps: int = 20, guidance_scale: float = 4.0,
          width: int | None = None, height: int | None = None) -> dict:
    """Generate one image per prompt and score it: fg/bg colour accuracy, their mean
    (``colour_accuracy``), ``shape_accuracy``, ``all_accuracy`` (all three right) and shape
    accuracy per shape asked for."""
    images = generate(pipe, prompts, seed, batch_size, num_inference_steps, guidance_scale,
                      width, height)
    return score_images(images, prompts)


def make_grid(images: np.ndarray, prompts: list[str], columns: int = 6, scale: int = 4):
    """A PIL image: ``images`` upscaled ``scale`` times (nearest neighbour) in a grid, each with
    its prompt underneath and, in red, what ``classify`` read where it differs from the prompt."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=12)
    height, width = images.shape[1] * scale, images.shape[2] * scale
    cell_w, caption, pad = max(width, 120), 44, 8
    rows = -(-len(images) // columns)
    grid = Image.new("RGB", (columns * (cell_w + pad) + pad, rows * (height + caption + pad) + pad),
                     (255, 255, 255))
    pen = ImageDraw.Draw(grid)
    for i, (image, prompt) in enumerate(zip(images, prompts)):
        x = pad + (i % columns) * (cell_w + pad)
        y = pad + (i // columns) * (height + caption + pad)
        tile = Image.fromarray(image).resize((width, height), Image.NEAREST)
        grid.paste(tile, (x + (cell_w - width) // 2, y))
        fg, shape, bg = parse_prompt(prompt)
        got_fg, got_bg, got_shape = classify(image)
        pen.text((x, y + height + 2), f"{fg} {shape}", fill=(0, 0, 0), font=font)
        pen.text((x, y + height + 15), f"on {bg}", fill=(0, 0, 0), font=font)
        if (got_fg, got_shape, got_bg) != (fg, shape, bg):
            pen.text((x, y + height + 28), f"read: {got_fg} {got_shape} / {got_bg}",
                     fill=(200, 0, 0), font=font)
    return grid


def evaluation_prompts(repeats: int = 2) -> list[str]:
    """The held-out prompts, each ``repeats`` times (with different seeds when generated)."""
    return held_out_prompts() * repeats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="diffusers pipeline directory")
    parser.add_argument("--repeats", type=int, default=2,
                        help="images per held-out prompt (default 2: 48 images)")
    parser.add_argument("--steps", type=int, default=None, help="default: diffserve.json's")
    parser.add_argument("--guidance", type=float, default=None, help="default: diffserve.json's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                        help="dtype to run in (CPU: float32)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grid", type=Path, default=None,
                        help="also save a PNG grid of one image per held-out prompt here")
    args = parser.parse_args(argv)

    import torch
    from diffusers import DiffusionPipeline

    from diffserve.builders.registry import serving_defaults

    torch.set_num_threads(args.threads)
    defaults = serving_defaults(args.model)
    pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype))
    pipe.set_progress_bar_config(disable=True)
    settings = dict(num_inference_steps=args.steps or defaults.get("num_inference_steps", 20),
                    guidance_scale=args.guidance or defaults.get("guidance_scale", 4.0),
                    width=defaults.get("width"), height=defaults.get("height"))
    started = time.perf_counter()
    result = score(pipe, evaluation_prompts(args.repeats), seed=args.seed, **settings)
    result.pop("predictions")
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["settings"] = settings | {"dtype": args.dtype, "seed": args.seed}
    print(json.dumps(result, indent=2))
    if args.grid is not None:
        prompts = held_out_prompts()
        make_grid(generate(pipe, prompts, seed=args.seed, **settings), prompts).save(args.grid)


if __name__ == "__main__":
    main()
