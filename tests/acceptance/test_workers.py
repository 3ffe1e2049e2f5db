"""Four `outbox relay` worker processes share one backlog; Redis shows every double publish.

Redis Streams keeps every copy (no broker-side dedup), so a row published by two
workers would appear twice in the stream.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import redis
from sqlalchemy import create_engine, insert, text
from sqlalchemy.pool import NullPool

from outbox import migrate, outbox_message
from outbox.message import build_message
from relay import store
from tests.helpers import workers_until
from tests.servers import RedisServer

OUTBOX = str(Path(sys.executable).with_name("outbox"))


def pending(pg_url: str) -> int:
    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.connect() as conn:
        n = store.pending_count(conn)
    engine.dispose()
    return n


def test_four_workers_drain_20000_rows_each_published_once(pg_url: str) -> None:
    migrate.upgrade(pg_url)
    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.begin() as conn:
        for start in range(0, 20_000, 5000):
            batch = [
                build_message("backlog.orders", {"n": n}, max_payload_bytes=1000)
                for n in range(start, start + 5000)
            ]
            conn.execute(
                insert(outbox_message),
                [{"msg_id": m.msg_id, "topic": m.topic, "payload": m.payload} for m in batch],
            )
        conn.execute(
            text("UPDATE outbox_message SET created_at = created_at - interval '1 minute'")
        )
    engine.dispose()
    server = RedisServer().start()
    env = {**os.environ, "OUTBOX_DB": pg_url, "OUTBOX_BROKER": server.url}
    try:
        command = [OUTBOX, "relay", "--interval", "0.2"]
        logs = workers_until(command, env, lambda: pending(pg_url) == 0, "the backlog drained")
    finally:
        client = redis.Redis.from_url(server.url)
        entries = client.xrange("backlog.orders")
        client.close()
        server.close()
    copies = Counter(fields[b"msg_id"] for _, fields in entries)
    assert len(copies) == 20_000
    assert max(copies.values()) == 1, "a row was published by two workers"
    shares = [log.count("sweep: claimed=") for log in logs]
    assert sum(1 for s in shares if s) >= 2, (
        f"the work should be shared, batches per worker: {shares}"
    )
