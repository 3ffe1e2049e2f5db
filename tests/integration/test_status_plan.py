"""`outbox status`, the dashboard's overview and the backlog gauges read the pending,
dead and recent rows only, never the whole retained ledger (issue 40, item 6).

PostgreSQL's plans, on a table holding 200,000 sent rows (two days and a bit of them)
beside 100 pending, 5 dead, 20 skipped and 20 canceled rows, freshly analyzed: each
statement the status and the overview run must reach outbox_message through an index,
with no sequential scan of it.

The sends of the last hour (settled_by_topic's sent_1m/sent_1h, sent_by_topic,
sent_per_minute_pg) read ix_outbox_message_sent_at, not ix_outbox_message_sent: that
one is (status, sent_at) over sent rows only, and PostgreSQL drops a condition its
partial index's predicate implies (status = 'sent') from the index's conditions, so its
leading column was unbounded and the planner read the whole table (revision 0009).
The skipped and canceled counts read ix_outbox_message_settled.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event, text

from relay import store
from relay.testing import scratch_schema
from tests.conftest import PG_URL
from tests.helpers import migrated

pytestmark = pytest.mark.xdist_group("status_plan")  # the large table built once
SENT_ROWS = 200_000
HOUR = timedelta(hours=1)


@pytest.fixture(scope="module")
def ledger() -> Iterator[Engine]:
    """A migrated PostgreSQL schema with a large retained ledger and a small backlog,
    VACUUM ANALYZEd (the statistics a running database has)."""
    with scratch_schema(PG_URL, "plan") as url, migrated(url) as engine:
        with engine.begin() as conn:
            plant(conn)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE outbox_message"))
        yield engine


def plant(conn: Connection) -> None:
    """A sent row a second for SENT_ROWS seconds back, and the few unsettled ones."""
    columns = "msg_id, topic, payload, status, created_at, sent_at, deliver_at, last_error"
    ago = "now() - make_interval(secs => g)"
    rows = {  # status: (how many, created_at, sent_at, deliver_at)
        "sent": (SENT_ROWS, ago, f"{ago} + interval '5 ms'", "NULL"),
        "pending": (100, "now()", "NULL", "NULL"),
        "dead": (5, "now()", "NULL", "NULL"),
        "skipped": (20, "now() - interval '2 days'", "NULL", "NULL"),
        "canceled": (20, "now() - interval '1 day'", "NULL", "now()"),
    }
    for status, (n, created, sent, due) in rows.items():
        conn.execute(
            text(
                f"INSERT INTO outbox_message ({columns}) SELECT gen_random_uuid(), "
                f"'t' || (g % 10), '\\x00', '{status}', {created}, {sent}, {due}, 'x' "
                f"FROM generate_series(1, {n}) g"
            )
        )


def statements(engine: Engine, read: Callable[[Connection], Any]) -> list[tuple[str, Any]]:
    """The statements ``read`` runs on outbox_message, with their parameters."""
    seen: list[tuple[str, Any]] = []

    def grab(*args: Any) -> None:
        statement, parameters = args[2], args[3]
        if "outbox_message" in statement:
            seen.append((statement, parameters))

    with engine.connect() as conn:
        event.listen(conn, "before_cursor_execute", grab)
        read(conn)
    return seen


def plan(engine: Engine, statement: str, parameters: Any) -> dict[str, Any]:
    with engine.connect() as conn:
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        cursor.execute("EXPLAIN (FORMAT JSON) " + statement, parameters)
        found = cursor.fetchone()[0]
        document = found if isinstance(found, list) else json.loads(found)
        return dict(document[0]["Plan"])


def nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from nodes(child)


def full_scans(engine: Engine, read: Callable[[Connection], Any]) -> list[str]:
    """The sequential scans of outbox_message in the plans of what ``read`` runs."""
    found = statements(engine, read)
    assert found, "the read ran no statement on outbox_message"
    return [
        statement.split("\n")[0][:80]
        for statement, parameters in found
        for node in nodes(plan(engine, statement, parameters))
        if node["Node Type"] == "Seq Scan" and node.get("Relation Name") == "outbox_message"
    ]


def now(conn: Connection) -> Any:
    return store.db_clock(conn)


def test_the_backlog_reads_the_pending_and_dead_rows_by_their_indexes(ledger: Engine) -> None:
    """`outbox status`, the overview and the gauges: store.backlog_by_topic."""
    assert full_scans(ledger, lambda c: store.backlog_by_topic(c, now(c))) == []


def test_the_blocked_keys_read_the_dead_rows_by_their_index(ledger: Engine) -> None:
    assert full_scans(ledger, lambda c: store.dead_heads(c, 20)) == []


def test_the_settled_counts_read_recent_and_settled_rows_only(ledger: Engine) -> None:
    assert full_scans(ledger, lambda c: store.settled_by_topic(c, now(c))) == []


def test_the_sends_of_the_last_hour_read_those_rows_only(ledger: Engine) -> None:
    assert full_scans(ledger, lambda c: store.sent_by_topic(c, now(c) - HOUR)) == []


def test_the_per_minute_chart_reads_the_last_hour_only(ledger: Engine) -> None:
    assert full_scans(ledger, lambda c: store.sent_per_minute_pg(c, now(c) - HOUR)) == []
