"""The synthetic dataset: one flat shape of one colour on a plain background of another colour.

Everything here is drawn with PIL and seeded, so the same call always gives the same images.
Prompts read ``"a red circle on a blue background"`` (``"an"`` before ``orange``).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 230),
    "yellow": (250, 225, 30),
    "white": (250, 250, 250),
    "black": (15, 15, 15),
    "purple": (140, 40, 180),
    "orange": (250, 140, 20),
}
COLOURS: tuple[str, ...] = tuple(PALETTE)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")

IMAGE_SIZE = 32
MIN_SIDE, MAX_SIDE = 10, 24
# Seed of the held-out split; changing it changes which combinations the model never sees.
SPLIT_SEED = 1234
NUM_HELD_OUT = 24


@dataclass(frozen=True)
class Combo:
    fg: str
    shape: str
    bg: str

    @property
    def prompt(self) -> str:
        return make_prompt(self.fg, self.shape, self.bg)


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def make_prompt(fg: str, shape: str, bg: str) -> str:
    return f"{article(fg)} {fg} {shape} on {article(bg)} {bg} background"


def all_combos() -> list[Combo]:
    """The 168 (foreground, shape, background) triples with foreground != background."""
    return [Combo(fg, shape, bg) for fg, shape, bg in itertools.product(COLOURS, SHAPES, COLOURS)
            if fg != bg]


def split_combos(num_held_out: int = NUM_HELD_OUT, seed: int = SPLIT_SEED) -> tuple[list[Combo], list[Combo]]:
    """(train, held_out). The held-out triples are never drawn for training, yet every colour
    still appears as foreground and as background, and with every shape, in the training part."""
    combos = all_combos()
    rng = random.Random(seed)
    while True:
        held = set(rng.sample(range(len(combos)), num_held_out))
        train = [c for i, c in enumerate(combos) if i not in held]
        seen_fg_shape = {(c.fg, c.shape) for c in train}
        seen_bg_shape = {(c.bg, c.shape) for c in train}
        seen_pair = {(c.fg, c.bg) for c in train}
        if (len(seen_fg_shape) == len(COLOURS) * len(SHAPES)
                and len(seen_bg_shape) == len(COLOURS) * len(SHAPES)
                and len(seen_pair) == len(COLOURS) * (len(COLOURS) - 1)):
            return train, [c for i, c in enumerate(combos) if i in held]


def held_out_prompts() -> list[str]:
    return [c.prompt for c in split_combos()[1]]


def draw(fg: str | tuple[int, int, int], shape: str, bg: str | tuple[int, int, int], side: int,
         x: int, y: int, size: int = IMAGE_SIZE) -> Image.Image:
    """``shape`` with a bounding box of ``side`` pixels whose top-left corner is at (x, y).
    Colours are palette names or RGB triples."""
    fill = PALETTE[fg] if isinstance(fg, str) else tuple(fg)
    image = Image.new("RGB", (size, size), PALETTE[bg] if isinstance(bg, str) else tuple(bg))
    pen = ImageDraw.Draw(image)
    x1, y1 = x + side - 1, y + side - 1
    if shape == "circle":
        pen.ellipse((x, y, x1, y1), fill=fill)
    elif shape == "square":
        pen.rectangle((x, y, x1, y1), fill=fill)
    elif shape == "triangle":
        pen.polygon(((x, y1), (x1, y1), (x + (side - 1) / 2, y)), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return image


def draw_random(combo: Combo, rng: random.Random, size: int = IMAGE_SIZE) -> Image.Image:
    """``combo`` at a random size in [MIN_SIDE, MAX_SIDE] and a random place that keeps at
    least one background pixel between the shape and the image border."""
    return _draw_placed(combo.fg, combo.shape, combo.bg, rng, size)


def _draw_placed(fg, shape, bg, rng: random.Random, size: int) -> Image.Image:
    scale = size / IMAGE_SIZE
    side = rng.randint(round(MIN_SIDE * scale), round(MAX_SIDE * scale))
    x = rng.randint(1, size - side - 1)
    y = rng.randint(1, size - side - 1)
    return draw(fg, shape, bg, side, x, y, size)


def make_dataset(count: int, combos: list[Combo], seed: int = 0,
                 size: int = IMAGE_SIZE) -> tuple[np.ndarray, list[str], list[Combo]]:
    """``count`` images cycling through ``combos`` in shuffled order: uint8 (count, size,
    size, 3), their prompts and their combos."""
    rng = random.Random(seed)
    images = np.empty((count, size, size, 3), dtype=np.uint8)
    picked: list[Combo] = []
    order: list[Combo] = []
    for i in range(count):
        if not order:
            order = list(combos)
            rng.shuffle(order)
        combo = order.pop()
        images[i] = np.asarray(draw_random(combo, rng, size))
        picked.append(combo)
    return images, [c.prompt for c in picked], picked
