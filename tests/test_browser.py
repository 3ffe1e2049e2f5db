"""The browser tests' setup (tests/browser.py): Debian's chromium runs a page's scripts."""

from __future__ import annotations

import asyncio
from pathlib import Path

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


def test_asyncio_runs_after_a_browser_test() -> None:
    """The suite's async tests call asyncio.run(): Playwright's loop is not left running."""

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert asyncio.run(answer()) == 42
