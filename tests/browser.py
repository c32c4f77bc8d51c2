"""Debian's Chromium driven by Playwright (no browser download), for the playground's tests;
a module that imports this is skipped where either is missing."""

from __future__ import annotations

import importlib.util
import os

import pytest

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM) or importlib.util.find_spec("playwright") is None:
    pytest.skip("the playground test drives Debian's Chromium through Playwright; install them "
                "with `apt-get install chromium` and `pip install playwright` (no browser "
                "download is needed)", allow_module_level=True)

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 30_000


def playground_server(model: str):
    """What a playground test's server is given: ``model``, one intra-op thread (declared with
    ``serves``, so it is launched ahead of the test)."""
    from server import spec

    return spec("--torch-threads", "1", model=model)


def launch(playwright, profile):
    """Chromium with a profile of the test's own."""
    return playwright.chromium.launch_persistent_context(
        str(profile), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
        viewport={"width": 1200, "height": 900})


def open_playground(context, url: str):
    """(the playground page, the JavaScript errors it raises as they come)."""
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(url + "/")
    return page, errors
