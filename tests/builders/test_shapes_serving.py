"""The default model through the real server, started as a user starts it (no --model): a mixed
batch of different prompts, sent concurrently, and EVERY image has the colours of its own prompt."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from diffserve.config.flags import DEFAULT_MODEL
from tools.shapes import data
from tools.shapes.evaluate import classify, parse_prompt
from server import decode, metric


def test_default_model_is_the_trained_shapes_model():
    assert DEFAULT_MODEL == "shapes"


@pytest.mark.server("--dynamic-batch-max-size", "8", "--dynamic-batch-delay-ms", "50", model=None)
def test_every_image_of_a_mixed_batch_has_its_own_prompts_colours(own_server):
    train, held_out = data.split_combos()
    # No two requests share both colours, so an image sent to the wrong caller shows.
    combos, pairs = [], set()
    for combo in held_out + train[::3]:
        if (combo.fg, combo.bg) not in pairs and len(combos) < 24:
            pairs.add((combo.fg, combo.bg))
            combos.append(combo)
    bodies = [{"prompt": c.prompt, "seed": 100 + i, "n": 1 + (i % 4 == 0)}
              for i, c in enumerate(combos)]
    with own_server as srv:
        with srv.client() as c:
            models = c.get("/v1/models").json()["data"]
            assert [m["id"] for m in models] == ["shapes"]
            with ThreadPoolExecutor(len(bodies)) as pool:
                responses = list(pool.map(lambda b: c.post("/v1/images/generations", json=b), bodies))
            text = c.get("/metrics").text
    assert [r.status_code for r in responses] == [200] * len(bodies)
    assert metric(text, "diffserve_batch_size_count") < len(bodies)  # they really were batched
    wrong = []
    for body, response in zip(bodies, responses):
        fg, _, bg = parse_prompt(body["prompt"])
        for item in response.json()["data"]:
            image = decode(item["b64_json"])
            assert image.shape == (data.IMAGE_SIZE, data.IMAGE_SIZE, 3)
            got_fg, got_bg, _ = classify(image)
            if (got_fg, got_bg) != (fg, bg):
                wrong.append((body["prompt"], item["seed"], got_fg, got_bg))
    assert not wrong, f"images with another prompt's colours: {wrong}"
