"""The playground's video tab in a real headless Chromium against ``diffserve serve`` on a tiny
Wan: prompt, size and frames, the job's progress, then the served MP4 plays in the page's
<video> (Chromium's own H.264 decoder reaches readyState >= 2 at the video's dimensions)."""

from __future__ import annotations

import pytest

from browser import launch, open_playground, playground_server  # skips without Chromium
from server import LAUNCHES, serves  # noqa: E402
from playwright.sync_api import expect, sync_playwright  # noqa: E402


@pytest.fixture(scope="module")
@serves(playground_server("tiny-wan"))
def server(request):
    with LAUNCHES.take(request) as srv:
        yield srv


def test_the_video_tab_shows_progress_then_plays_the_mp4(server, tmp_path):
    with sync_playwright() as playwright:
        browser = launch(playwright, tmp_path / "profile")
        page, errors = open_playground(browser, server.url)
        expect(page.locator("#video-fields")).to_be_visible()
        expect(page.locator("#generate")).to_be_disabled()  # images are not this model's
        page.fill("#prompt", "a spinning cube")
        page.fill("#size", "48x32")
        page.fill("#frames", "17")
        page.fill("#steps", "30")
        page.click("#make-video")
        page.wait_for_selector("#video-out[data-state=done]", state="attached")
        assert page.inner_text("#message") == ""
        assert page.eval_on_selector("#video-progress", "p => p.value") == 100
        page.wait_for_function("() => document.getElementById('video').readyState >= 2")
        size = page.eval_on_selector("#video", "v => [v.videoWidth, v.videoHeight, v.duration]")
        assert size[:2] == [48, 32]
        assert size[2] == pytest.approx(17 / 8, abs=0.15)  # tiny-wan's 8 fps
        browser.close()
    assert errors == []
