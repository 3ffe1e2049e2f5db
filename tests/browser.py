"""Headless Chromium for the tests that look at a page: the reports and the dashboard.

Playwright's sync API drives Debian's chromium (`make test` installs it as
/usr/bin/chromium): `playwright install` downloads a browser build this machine cannot
fetch. One browser for the whole test session (``browser``); each test gets a fresh
context and page of 1280x800 (``page``). Registered from tests/conftest.py
(``pytest_plugins``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

CHROMIUM = "/usr/bin/chromium"
VIEWPORT = {"width": 1280, "height": 800}
# Playwright's defaults (5 s for expect, 30 s for actions) are for an idle machine; the
# suite shares two cores with Spark and brokers.
BUSY_MACHINE_MS = 60_000
expect.set_options(timeout=30_000)

# Playwright's event loop. Its sync API marks that loop as the thread's running loop
# between calls, and the suite's other tests call asyncio.run(), which refuses to start
# inside a running loop: the loop is marked only while a test that uses the browser runs.
_loop: list[asyncio.AbstractEventLoop] = []


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    """One headless chromium per test session (fails loudly when it is not installed)."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make services` installs Debian's chromium")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        _loop.append(asyncio.get_running_loop())
        asyncio._set_running_loop(None)
        yield launched
        asyncio._set_running_loop(_loop.pop())
        launched.close()
    asyncio._set_running_loop(None)


@pytest.fixture(autouse=True)
def _playwright_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Playwright's loop marked running for a test using the browser, and unmarked after."""
    if "browser" not in request.fixturenames:
        yield
        return
    request.getfixturevalue("browser")
    asyncio._set_running_loop(_loop[0])
    try:
        yield
    finally:
        asyncio._set_running_loop(None)


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A page of a fresh context (no cookies or storage shared), 1280x800."""
    context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
    context.set_default_timeout(BUSY_MACHINE_MS)
    try:
        yield context.new_page()
    finally:
        context.close()


def screenshot(page: Page, tmp_path: Path, name: str) -> Path:
    """The whole page as ``tmp_path/name.png``, to look at when a test fails."""
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
