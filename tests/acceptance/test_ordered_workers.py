"""Four `outbox relay` workers over 100 keys x 30 ordered rows: Redis receives each key
in seq order, and no two rows of a key were ever in flight at once, in any worker."""

from __future__ import annotations

import itertools
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from outbox import migrate, outbox_message
from relay.brokers.redis import entry_of
from relay.testing.order import gaps, out_of_order
from tests.helpers import unsent, wait_until, workers_until
from tests.integration.test_ordered_sweeper import age_rows, send_ordered
from tests.servers import RedisServer

t = outbox_message
KEYS, PER_KEY = 100, 30


@pytest.mark.parametrize("db", ["pg_url", "mariadb_url"])
def test_four_workers_publish_each_key_in_order_one_row_at_a_time(
    db: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = str(request.getfixturevalue(db))
    migrate.upgrade(url)
    engine = create_engine(url, poolclass=NullPool)
    send_ordered(engine, KEYS, PER_KEY, topic="ordered.orders")  # not due for an hour
    server = RedisServer().start()
    times = tmp_path / "times"
    env = {**os.environ, "OUTBOX_DB": url, "OUTBOX_BROKER": server.url,
           "OUTBOX_TEST_TIMES": str(times), "OUTBOX_SWEEP_BATCH": "100",
           "OUTBOX_SWEEPER_AGE_S": "3600"}  # fmt: skip
    command = [sys.executable, "-m", "tests.acceptance.timed_relay", "relay", "--interval", "0.1"]

    def due_once_all_sweep() -> None:  # however slowly each worker started
        sweeping = times.with_name("times.sweeping")
        wait_until(lambda: sweeping.exists() and len(set(sweeping.read_text().split())) == 4,
                   timeout=120, what="the four workers sweeping", every=0.05)  # fmt: skip
        age_rows(engine, 7200)

    try:
        logs = workers_until(
            command,
            env,
            lambda: unsent(url) == 0,
            "every key delivered",
            started=due_once_all_sweep,
        )
    finally:
        engine.dispose()
        client = redis.Redis.from_url(server.url)
        entries = client.xrange("ordered.orders")
        client.close()
        server.close()
    held = [entry_of("ordered.orders", entry_id, fields) for entry_id, fields in entries]
    assert not out_of_order(held) and not gaps(held)
    assert len({h.msg_id for h in held}) == KEYS * PER_KEY
    assert_one_at_a_time(times.read_text().splitlines())
    shares = [log.count("sweep: claimed=") for log in logs]
    assert sum(1 for s in shares if s) >= 2, f"the work should be shared: {shares}"


def assert_one_at_a_time(lines: list[str]) -> None:
    """Per key, the publishes (start, end) of its rows never overlap, and each row's
    publish starts after the first successful one of the row before it ended."""
    by_key: dict[str, list[tuple[int, int, int, bool]]] = defaultdict(list)
    for line in lines:
        start, end, key, seq, _, ok = line.split()
        by_key[key].append((int(start), int(end), int(seq), ok == "1"))
    assert len(by_key) == KEYS
    for key, spans in by_key.items():
        spans.sort()
        for (_, end, seq, _), (start, _, next_seq, _) in itertools.pairwise(spans):
            assert start >= end, f"{key}: seq {next_seq} started while seq {seq} was in flight"
        first_ack = sorted((s for s in spans if s[3]), key=lambda s: -s[1])  # earliest last
        acked = {seq: end for _, end, seq, _ in first_ack}
        for start, _, seq, _ in spans:
            if seq > 1:
                assert seq - 1 in acked and acked[seq - 1] <= start, f"{key}: seq {seq} early"
