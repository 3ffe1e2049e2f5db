"""docs/dashboard.png: a demo-like dataset in a scratch schema, the overview in headless
chromium (Debian's, as the browser tests).

    python scripts/dashboard_screenshot.py docs/dashboard.png
"""
# ruff: noqa: E501  (the seed's SQL reads best one statement clause a line)

import sys
import threading
import time

import uvicorn
from playwright.sync_api import sync_playwright
from sqlalchemy import create_engine, text

from outbox import migrate
from relay.dashboard import create_app
from relay.testing import scratch_schema
from relay.testing.embedded import free_port

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
with scratch_schema("postgresql+psycopg://postgres@127.0.0.1:5432/test", "shot") as url:
    migrate.upgrade(url)
    engine = create_engine(url)
    with engine.begin() as conn:
        for statement in SEED.split(";\n"):
            if statement.strip():
                conn.execute(text(statement))
    app = create_app(engine)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium")
        page = browser.new_page(viewport={"width": 1280, "height": 760})
        page.goto(f"http://127.0.0.1:{server.config.port}/")
        page.locator("#chart-latency .main-svg").first.wait_for()
        time.sleep(1)  # plotly's transitions
        page.screenshot(path=sys.argv[1])
        browser.close()
    server.should_exit = True
    thread.join()
    engine.dispose()
