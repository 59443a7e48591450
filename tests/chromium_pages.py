"""Open aitune's HTML pages in a real headless Chromium (playwright), refusing every fetch.

Used by the report and inspection-page tests (tests/unit/test_report_html.py, tests/unit/test_jit_inspection.py,
tests/compat). ``launch()`` skips the
test, with the install command as reason, when Chromium or playwright is missing.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextlib.contextmanager
def launch() -> Iterator:
    """A Chromium browser (playwright), or ``pytest.skip`` naming what to install."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Chromium not found at /usr/bin/chromium: apt-get install -y chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright not installed: pip install playwright")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser, path: Path):
    """Open ``path``; returns (page, console errors, requests for anything but the file itself, each aborted)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors, outside = [], []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("request", lambda request: None if request.url.startswith(("file://", "data:", "about:"))
            else outside.append(request.url))
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file://") else route.abort())
    page.goto(path.resolve().as_uri(), wait_until="load")
    return page, errors, outside


def assert_figure_drawn(page, kind: str, expected_texts: list[str]) -> None:
    """The page's ``figure.chart[data-figure=kind]`` SVG is laid out, draws shapes and shows ``expected_texts``."""
    svg = page.locator(f'figure.chart[data-figure="{kind}"] svg').first
    box = svg.bounding_box()
    assert box and box["width"] > 200 and box["height"] > 80, (kind, box)
    drawn = svg.evaluate("svg => [...svg.querySelectorAll('path, rect')].filter(e => { const b = e.getBBox(); "
                         "return b.width > 0 || b.height > 0; }).length")
    assert drawn >= 5, (kind, drawn)
    for text in expected_texts:
        assert svg.locator("text", has_text=text).first.is_visible(), (kind, text)


def check_inspection_page(browser, path: Path, module_names: list[str], figure_labels: list[str]) -> None:
    """The Model Inspector page at ``path`` loads without errors or fetches, draws its figure with
    ``figure_labels``, and its tree holds ``module_names``, folding and unfolding without any script."""
    page, errors, outside = open_page(browser, path)
    try:
        assert_figure_drawn(page, "time-share", figure_labels)
        nodes = page.locator(".tree details.node")
        assert nodes.count() == len(module_names)
        names = [nodes.nth(i).locator("summary").first.locator("code").first.inner_text() for i in range(nodes.count())]
        assert names == module_names
        root = nodes.first
        assert root.get_attribute("open") is not None and root.locator("summary").first.is_visible()
        leaf = page.locator(".tree details.node:not(:has(details.node))").first  # a module without children
        assert leaf.get_attribute("open") is None and not leaf.locator("table.node-info").is_visible()
        leaf.locator("summary").first.click()
        assert leaf.locator("table.node-info").is_visible()  # <details> unfolds with no script
        assert "calls" in leaf.locator("table.node-info").inner_text()
        leaf.locator("summary").first.click()
        assert not leaf.locator("table.node-info").is_visible()
        assert page.locator("table.modules tbody tr").count() >= 1
        assert page.evaluate("document.scripts.length") == 0
    finally:
        page.close()
    assert errors == [] and outside == [], (errors, outside)
