"""The dashboard in headless Chromium: the overview updates itself and greys its figures
when an update fails, a hostile payload never runs, every page fits a 420 px screen, and
a dead message requeued through the login form and the confirm step is then delivered
by a real relay."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from playwright.sync_api import Browser, Page, expect
from sqlalchemy import create_engine, text, update
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Outbox, migrate
from outbox.table import outbox_message as t
from relay.dashboard import create_app
from relay.testing.embedded import NatsServer, free_port
from tests.acceptance.test_cli import OUTBOX, count
from tests.browser import BUSY_MACHINE_MS, VIEWPORT, screenshot
from tests.helpers import wait_until

TOKEN = "token-" + uuid.uuid4().hex
HOSTILE = "<img src=x onerror=window.__pwned=1><script>window.__pwned=1</script>"


@pytest.fixture
def dashboard(pg_url: str) -> Iterator[str]:
    """The dashboard (actions on) served by uvicorn in a thread; its base URL."""
    migrate.upgrade(pg_url)
    app = create_app(pg_url, allow_actions=True, token=TOKEN)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=30, what="uvicorn to start")
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive(), "uvicorn did not stop"


def send(db: str, topic: str, n: int, payload: bytes = b'{"n": 1}') -> list[str]:
    engine = create_engine(db, poolclass=NullPool)
    ob = Outbox(engine)
    with Session(engine) as session, session.begin():
        ids = [ob.send(session, topic, payload) for _ in range(n)]
    engine.dispose()
    return ids


def change(db: str, ids: list[str], **values: object) -> None:
    engine = create_engine(db, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(update(t).where(t.c.msg_id.in_([uuid.UUID(i) for i in ids])).values(**values))
    engine.dispose()


def test_overview_updates_live_and_hostile_text_never_runs(
    page: Page, browser: Browser, dashboard: str, pg_url: str, tmp_path: Path
) -> None:
    [hostile] = send(pg_url, "shop.hostile", 1, HOSTILE.encode())
    change(
        pg_url, [hostile], topic=HOSTILE, key=HOSTILE, seq=1, status="dead", last_error=HOSTILE
    )  # fmt: skip  (a dead head: a blocked key too)
    page.goto(dashboard + "/")
    expect(page.locator("#chart-throughput .main-svg").first).to_be_visible()  # Plotly drew
    expect(page.locator('#total [data-field="pending"]')).to_have_text("0")
    page.evaluate("window.__sameDocument = true")
    send(pg_url, "shop.orders", 3)
    expect(page.locator('#total [data-field="pending"]')).to_have_text("3", timeout=30_000)
    expect(page.locator('tr[data-topic="shop.orders"]')).to_be_visible()
    sent = send(pg_url, "shop.orders", 2)
    change(pg_url, sent, status="sent", sent_at=t.c.created_at)
    expect(page.locator('#total [data-field="sent_1h"]')).to_have_text("2", timeout=30_000)
    assert page.evaluate("window.__sameDocument") is True  # updated in place, no reload
    screenshot(page, tmp_path, "overview")
    # Without the Content-Security-Policy's help: the escaping alone keeps it from running.
    bare = browser.new_context(viewport=VIEWPORT, bypass_csp=True)  # type: ignore[arg-type]
    try:
        hostile_pages_run_nothing(bare.new_page(), dashboard, hostile, tmp_path)
    finally:
        bare.close()


def hostile_pages_run_nothing(page: Page, dashboard: str, hostile: str, tmp_path: Path) -> None:
    for path in ["/", "/dead", f"/messages/{hostile}", "/blocked"]:
        page.goto(dashboard + path)
        if path == "/":  # its script has put the topics in from /api/overview
            page.wait_for_function("Number(document.body.dataset.refreshed) >= 1")
        expect(page.get_by_text(HOSTILE).first).to_be_visible()  # shown as text
        assert page.locator("img[src='x']").count() == 0, path
        assert page.evaluate("typeof window.__pwned") == "undefined", path
        screenshot(page, tmp_path, path.strip("/").replace("/", "-") or "overview-hostile")


def test_dead_message_requeued_with_the_token_is_delivered(
    page: Page, dashboard: str, pg_url: str, tmp_path: Path, nats_server: NatsServer,
    stream: tuple[str, str],
) -> None:  # fmt: skip
    name, prefix = stream
    [dead] = send(pg_url, f"{prefix}.orders", 1)
    change(pg_url, [dead], status="dead", attempts=5, last_error="broker said no",
           created_at=t.c.created_at - text("interval '1 minute'"))  # fmt: skip
    env = {**os.environ, "OUTBOX_DB": pg_url,
           "OUTBOX_BROKER": f"{nats_server.url}?stream={name}&subjects={prefix}.>"}  # fmt: skip
    relay = subprocess.Popen([OUTBOX, "relay", "--interval", "0.2"], env=env,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        page.goto(f"{dashboard}/messages/{dead}")
        page.click("#action-requeue")
        expect(page.locator("#token")).to_be_visible()  # not logged in: the login form
        page.fill("#token", TOKEN)
        page.click("#login")
        expect(page.locator("#confirm")).to_be_visible()  # the confirm step
        screenshot(page, tmp_path, "confirm")
        assert count(pg_url, "dead") == 1
        page.click("#confirm")
        expect(page.locator("#outcome")).to_contain_text("requeued")
        screenshot(page, tmp_path, "requeued")
        wait_until(lambda: count(pg_url, "sent") == 1, timeout=60, what="the relay to deliver it")
    finally:
        relay.send_signal(signal.SIGTERM)
        _, log = relay.communicate(timeout=30)
    assert relay.returncode == 0, log
    page.goto(f"{dashboard}/messages/{dead}")
    expect(page.locator("#message")).to_contain_text("sent")
    assert list(tmp_path.glob("*.png"))


def test_overview_greys_stale_figures_until_an_update_works_again(
    page: Page, dashboard: str, tmp_path: Path
) -> None:
    """An update that fails (the database down: /api/overview answers 503) leaves the last
    figures on the page: they turn grey under a "stale since" badge, which goes when an
    update works again. Every page names an icon that is there: no 404 in the console."""
    failed: list[tuple[int, str]] = []
    page.on("response", lambda r: failed.append((r.status, r.url)) if r.status >= 400 else None)
    page.goto(dashboard + "/")
    expect(page.locator("body")).to_have_attribute("data-refreshed", re.compile(r"\d"))
    stale, total = page.locator("#stale"), page.locator('#total [data-field="pending"]')
    expect(stale).to_be_hidden()
    fresh_colour = total.evaluate("cell => getComputedStyle(cell).color")
    down = json.dumps({"error": "the database does not answer (OperationalError)"})
    page.route("**/api/overview", lambda route: route.fulfill(status=503, body=down))
    expect(stale).to_have_text(re.compile(r"^stale since \d\d:\d\d:\d\d$"))
    expect(page.locator("body")).to_have_class(re.compile(r"\bstale\b"))
    assert "does not answer" in (stale.get_attribute("title") or "")
    assert total.evaluate("cell => getComputedStyle(cell).color") != fresh_colour
    screenshot(page, tmp_path, "overview-stale")
    page.unroute("**/api/overview")
    expect(stale).to_be_hidden()
    expect(page.locator("body")).not_to_have_class(re.compile(r"\bstale\b"))
    icon = page.locator('link[rel="icon"]').get_attribute("href")
    assert page.request.get(dashboard + str(icon)).status == 200
    assert page.request.get(dashboard + "/favicon.ico").status == 200
    assert [(s, u) for s, u in failed if not u.endswith("/api/overview")] == []


NARROW = {"width": 420, "height": 800}


def test_every_page_fits_a_420_px_screen(
    browser: Browser, dashboard: str, pg_url: str, tmp_path: Path
) -> None:
    """No page scrolls sideways on a phone: tables scroll inside their own box."""
    long = "shop.orders.europe.west.priority-" + "x" * 60
    [dead] = send(pg_url, long, 1, b'{"order": "' + b"y" * 300 + b'"}')
    head, _behind = send(pg_url, "shop.ordered", 2)
    change(pg_url, [dead], status="dead", attempts=5, last_error="broker said no: " + "z" * 200)
    change(pg_url, [head], key="customer-42", seq=1, status="dead", last_error="boom")
    context = browser.new_context(viewport=NARROW)  # type: ignore[arg-type]
    context.set_default_timeout(BUSY_MACHINE_MS)
    page = context.new_page()
    try:
        for path in ["/", "/dead", "/blocked", "/halfop", "/reports", f"/messages/{dead}",
                     f"/messages/{dead}/requeue", "/dead?limit=%C2%B2"]:  # fmt: skip
            page.goto(dashboard + path)
            if path == "/":
                expect(page.locator("body")).to_have_attribute("data-refreshed", re.compile(r"\d"))
                expect(page.locator("#chart-throughput .main-svg").first).to_be_visible()
            wide = page.evaluate("document.documentElement.scrollWidth")
            assert wide <= NARROW["width"], (path, wide)
            screenshot(page, tmp_path, "narrow" + re.sub(r"[^a-z0-9]+", "-", path))
    finally:
        context.close()
