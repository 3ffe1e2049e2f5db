"""The browser tests' setup (tests/browser.py): Debian's chromium runs a page's scripts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from playwright.sync_api import Page

from tests.browser import screenshot

PAGE = """<!doctype html><html><body style="margin:0">
<p id="out">not run</p>
<script>document.getElementById("out").textContent = 6 * 7;</script>
</body></html>"""


def test_a_local_page_runs_its_script_at_1280_px(page: Page, tmp_path: Path) -> None:
    file = tmp_path / "page.html"
    file.write_text(PAGE)
    page.goto(file.as_uri())
    assert page.text_content("#out") == "42"
    assert page.evaluate("window.innerWidth") == 1280
    assert screenshot(page, tmp_path, "page").stat().st_size > 0


def test_asyncio_runs_after_a_browser_test(request: pytest.FixtureRequest) -> None:
    """The suite's async tests call asyncio.run(): Playwright's loop is not left running.
    The browser is asked for here, not as a parameter: this xdist worker has started it
    whatever ran before, and the test runs as one that does not use it."""
    request.getfixturevalue("browser")

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert asyncio.run(answer()) == 42
