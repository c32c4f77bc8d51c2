"""The shapes model: its dataset, its evaluator and its shipped weights."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from diffserve.builders.shapes import WEIGHTS_DIR
from tools.shapes import data
from tools.shapes.evaluate import classify, parse_prompt, score

# Shape accuracy measured on the same prompts and seeds when the weights were made, less a margin
# (see docs/shapes.md).
MIN_SHAPE_ACCURACY = 0.8
MIN_COLOUR_ACCURACY = 0.95


def test_every_combination_is_drawn_as_its_prompt_says():
    rng = random.Random(7)
    for combo in data.all_combos():
        for _ in range(3):
            image = np.asarray(data.draw_random(combo, rng))
            assert image.shape == (data.IMAGE_SIZE, data.IMAGE_SIZE, 3)
            assert image.dtype == np.uint8
            fg, shape, bg = parse_prompt(combo.prompt)
            assert (fg, shape, bg) == (combo.fg, combo.shape, combo.bg)
            assert classify(image) == (fg, bg, shape), combo.prompt


@pytest.mark.parametrize("side", [data.MIN_SIDE, data.MAX_SIDE])
def test_smallest_and_largest_shapes_are_recognised(side):
    for shape in data.SHAPES:
        image = np.asarray(data.draw("white", shape, "black", side, 2, 3))
        assert classify(image) == ("white", "black", shape)


def test_dataset_is_seeded_and_matches_its_prompts():
    train, _ = data.split_combos()
    images, prompts, combos = data.make_dataset(64, train, seed=3)
    again, prompts_again, _ = data.make_dataset(64, train, seed=3)
    assert np.array_equal(images, again) and prompts == prompts_again
    assert not np.array_equal(images, data.make_dataset(64, train, seed=4)[0])
    for image, prompt, combo in zip(images, prompts, combos):
        assert prompt == combo.prompt
        fg, shape, bg = parse_prompt(prompt)
        assert classify(image) == (fg, bg, shape)


def test_held_out_split():
    train, held = data.split_combos()
    assert len(train) + len(held) == 168 == len(data.all_combos())
    assert len(held) == data.NUM_HELD_OUT
    assert not set(train) & set(held)
    assert data.split_combos() == (train, held)
    assert data.held_out_prompts() == [c.prompt for c in held]


def test_parse_prompt():
    assert parse_prompt("a red circle on a blue background") == ("red", "circle", "blue")
    assert parse_prompt("An orange Triangle on a white background.") == ("orange", "triangle", "white")
    assert parse_prompt("a orange square on an orange background") == ("orange", "square", "orange")
    for bad in ("a red hexagon on a blue background", "a pink circle on a blue background",
                "red circle, blue background"):
        with pytest.raises(ValueError):
            parse_prompt(bad)


def test_classify_blank_image():
    image = np.full((32, 32, 3), data.PALETTE["green"], dtype=np.uint8)
    assert classify(image) == ("none", "green", "none")


def test_serving_defaults_file():
    defaults = json.loads((WEIGHTS_DIR / "diffserve.json").read_text())
    assert set(defaults) == {"width", "height", "spatial_stride", "num_inference_steps",
                             "guidance_scale"}
    assert defaults["width"] % defaults["spatial_stride"] == 0


def test_shipped_weights_draw_held_out_prompts():
    torch = pytest.importorskip("torch")
    from diffusers import DiffusionPipeline

    defaults = json.loads((WEIGHTS_DIR / "diffserve.json").read_text())
    pipe = DiffusionPipeline.from_pretrained(WEIGHTS_DIR, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    assert pipe.unet.dtype == torch.float32
    prompts = data.held_out_prompts() * 2  # 48 images, seeds 0..47
    result = score(pipe, prompts, seed=0, batch_size=len(prompts),
                   num_inference_steps=defaults["num_inference_steps"],
                   guidance_scale=defaults["guidance_scale"],
                   width=defaults["width"], height=defaults["height"])
    assert result["fg_accuracy"] >= MIN_COLOUR_ACCURACY, result
    assert result["bg_accuracy"] >= MIN_COLOUR_ACCURACY, result
    assert result["shape_accuracy"] >= MIN_SHAPE_ACCURACY, result
