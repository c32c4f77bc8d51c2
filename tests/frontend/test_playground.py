"""The playground page (GET /) in a real headless Chromium against a real ``diffserve serve``:
a streamed generation with previews, the status bar, an edit with a painted mask, an error."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
from PIL import Image, ImageDraw

from browser import launch, open_playground, playground_server  # skips without Chromium
from server import LAUNCHES, serves  # noqa: E402
from playwright.sync_api import expect, sync_playwright  # noqa: E402

PROMPT = "a red circle on a blue background"


@pytest.fixture(scope="module")
@serves(playground_server("shapes"))
def server(request):
    with LAUNCHES.take(request) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as playwright:
        context = launch(playwright, profile)
        yield context
        context.close()


@pytest.fixture
def page(browser, server):
    page, errors = open_playground(browser, server.url)
    # The model card has loaded once Edit is enabled (the shapes model edits and inpaints).
    expect(page.locator("#edit")).to_be_enabled()
    yield page
    page.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


def final_images(page, action: str) -> list[Image.Image]:
    """Wait until the request ``action`` finished, and decode its final images."""
    page.wait_for_selector(f"#results[data-action={action}][data-state=done]", state="attached")
    assert page.inner_text("#message") == ""
    images = []
    for src in page.eval_on_selector_all("#results img.final", "els => els.map(e => e.src)"):
        match = re.fullmatch(r"data:image/png;base64,(.+)", src)
        assert match, src[:60]
        image = Image.open(io.BytesIO(base64.b64decode(match.group(1))))
        image.load()
        images.append(image)
    return images


def test_generate_streams_previews_then_final_image(page):
    page.fill("#prompt", PROMPT)
    page.fill("#steps", "8")
    page.fill("#partial_images", "2")
    page.fill("#seed", "7")
    page.click("#generate")

    # The final image element appears, a PNG data URL, after previews were shown in its slot.
    final = page.locator("#results img.final")
    expect(final).to_have_attribute("src", re.compile(r"^data:image/png;base64,"))
    (image,) = final_images(page, "generation")
    assert image.format == "PNG" and image.size == (32, 32)
    slot = page.locator("#results .slot")
    assert int(slot.get_attribute("data-previews")) >= 1
    assert slot.get_attribute("data-seed") == "7"
    expect(slot.locator("figcaption")).to_contain_text("seed 7")
    expect(page.locator("#elapsed")).to_have_text(re.compile(r"\d+\.\d+ s"))


def test_status_shows_model_mode_and_queue(page):
    expect(page.locator("#st-model")).to_have_text("shapes")
    expect(page.locator("#st-mode")).to_have_text("step")
    expect(page.locator("#st-executors")).to_have_text("1/1")
    expect(page.locator("#st-queue")).to_have_text(re.compile(r"^\d+$"))
    expect(page.locator("#st-running")).to_have_text(re.compile(r"^\d+$"))


def test_edit_with_a_painted_mask(page, tmp_path):
    source = Image.new("RGB", (32, 32), (30, 60, 200))
    ImageDraw.Draw(source).ellipse((8, 8, 24, 24), fill=(220, 30, 30))
    path = tmp_path / "input.png"
    source.save(path)

    page.fill("#prompt", PROMPT)
    page.fill("#steps", "8")
    page.fill("#n", "2")
    page.set_input_files("#image", str(path))
    page.wait_for_function("document.getElementById('mask-canvas').width === 32")
    box = page.locator("#mask-canvas").bounding_box()
    page.mouse.move(box["x"] + 0.1 * box["width"], box["y"] + 0.5 * box["height"])
    page.mouse.down()
    page.mouse.move(box["x"] + 0.9 * box["width"], box["y"] + 0.5 * box["height"], steps=8)
    page.mouse.up()

    # The mask the page sends: a grayscale PNG of the image's size, the stroke white on black.
    mask_b64 = page.evaluate("""async () => {
        const bytes = new Uint8Array(await (await maskPng()).arrayBuffer());
        let text = ""; for (const b of bytes) text += String.fromCharCode(b);
        return btoa(text); }""")
    mask = Image.open(io.BytesIO(base64.b64decode(mask_b64)))
    assert (mask.format, mask.mode, mask.size) == ("PNG", "L", (32, 32))
    pixels = np.asarray(mask)
    assert set(np.unique(pixels)) == {0, 255}
    assert pixels[16, 16] == 255 and pixels[0, 0] == 0 and pixels[31, 16] == 0

    page.click("#edit")
    images = final_images(page, "edit")
    assert [(im.format, im.size) for im in images] == [("PNG", (32, 32))] * 2
    assert page.locator("#results .slot[data-state=final]").count() == 2
    assert int(page.get_attribute("#results", "data-previews")) >= 2


def test_error_message_is_shown(page):
    page.fill("#prompt", PROMPT)
    page.fill("#size", "33x33")
    page.click("#generate")
    page.wait_for_selector("#results[data-state=failed]", state="attached")
    expect(page.locator("#message")).to_contain_text("size '33x33'")
    expect(page.locator("#results .slot")).to_have_count(0)  # no image was started
