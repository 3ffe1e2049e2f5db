"""docs/dashboard.png: a demo-like dataset in a scratch schema, the overview in headless
chromium (Debian's, as the browser tests).

    python scripts/dashboard_screenshot.py docs/dashboard.png --db postgresql+psycopg://...
    (or OUTBOX_TEST_PG=postgresql+psycopg://... python scripts/dashboard_screenshot.py OUT)
"""
# ruff: noqa: E501  (the seed's SQL reads best one statement clause a line)

import argparse
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from playwright.sync_api import sync_playwright
from sqlalchemy import create_engine, text

from outbox import migrate
from relay.dashboard import create_app
from relay.testing import scratch_schema
from relay.testing.embedded import free_port

CHROMIUM = "/usr/bin/chromium"  # Debian's, as the browser tests (tests/browser.py)

SEED = """
INSERT INTO outbox_message (msg_id, topic, key, seq, payload, status, attempts, last_error, created_at, sent_at)
SELECT gen_random_uuid(), t.topic, NULL, NULL, convert_to('{"sku": "A-' || i || '"}', 'UTF8'), 'sent', 1, NULL,
       now() - (i * interval '1 s') - ((8 + 30 * random() ^ 4) * interval '1 ms'), now() - (i * interval '1 s')
FROM generate_series(1, 3500) AS i, (VALUES ('warehouse.inbound'), ('warehouse.outbound'), ('billing.invoice')) AS t(topic)
WHERE t.topic <> 'billing.invoice' OR i % 3 = 0;
INSERT INTO outbox_message (msg_id, topic, payload, status, attempts, created_at)
SELECT gen_random_uuid(), 'warehouse.inbound', convert_to('{"sku": "B"}', 'UTF8'), 'pending', 0, now() - (i * interval '40 ms')
FROM generate_series(1, 37) AS i;
INSERT INTO outbox_message (msg_id, topic, payload, status, attempts, last_error, created_at)
SELECT gen_random_uuid(), 'billing.invoice', convert_to('{"invoice": ' || i || '}', 'UTF8'), 'dead', 13, 'nats: no responders available for request', now() - (i * interval '5 min')
FROM generate_series(1, 6) AS i;
INSERT INTO outbox_message (msg_id, topic, key, seq, payload, status, attempts, last_error, created_at, deliver_at)
VALUES (gen_random_uuid(), 'warehouse.outbound', 'order-17', 1, '\\x7b7d', 'dead', 13, 'message too large', now() - interval '20 min', NULL),
       (gen_random_uuid(), 'warehouse.outbound', 'order-17', 2, '\\x7b7d', 'pending', 0, NULL, now() - interval '19 min', NULL),
       (gen_random_uuid(), 'billing.invoice', NULL, NULL, '\\x7b7d', 'pending', 0, NULL, now(), now() + interval '2 hours');
"""


@contextmanager
def seeded(db: str) -> Iterator[str]:
    """A scratch schema of ``db`` holding the demo-like dataset (SEED); its URL."""
    with scratch_schema(db, "shot") as url:
        migrate.upgrade(url)
        engine = create_engine(url)
        with engine.begin() as conn:
            for statement in SEED.split(";\n"):
                if statement.strip():
                    conn.execute(text(statement))
        engine.dispose()
        yield url


@contextmanager
def serving(url: str) -> Iterator[str]:
    """The dashboard on ``url`` in a thread (uvicorn); its base URL."""
    server = uvicorn.Server(
        uvicorn.Config(create_app(url), host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise SystemExit("the dashboard did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def screenshot(base: str, out: str) -> None:
    """The overview once Plotly has drawn both charts, 1280x760."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        page = browser.new_page(viewport={"width": 1280, "height": 760})
        page.goto(f"{base}/")
        page.locator("#chart-latency .main-svg").first.wait_for()
        page.wait_for_function("document.body.dataset.refreshed >= 1")
        page.wait_for_timeout(1000)  # Plotly's transitions end: a still picture
        page.screenshot(path=out)
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the PNG to write, e.g. docs/dashboard.png")
    parser.add_argument(
        "--db",
        default=os.environ.get("OUTBOX_TEST_PG"),
        help="a PostgreSQL URL to make a scratch schema in (default: $OUTBOX_TEST_PG)",
    )
    args = parser.parse_args()
    if not args.db:
        parser.error("--db is required (or set OUTBOX_TEST_PG)")
    with seeded(args.db) as url, serving(url) as base:
        screenshot(base, args.out)


if __name__ == "__main__":
    main()
