"""What `outbox status`, the dashboard and the gauges count: the backlog per topic, the
settled rows, the sends over time."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import (
    Connection,
    LargeBinary,
    and_,
    case,
    func,
    or_,
    select,
)

from outbox.dialects import dialect_for
from outbox.table import CANCELED, DEAD, PENDING, SENT, SKIPPED, outbox_message
from relay.store.keys import behind_dead, blocking_head
from relay.store.schedule import due_time, is_due, waiting_since

t = outbox_message


def count_if(condition: Any) -> Any:
    """How many rows of the group meet ``condition`` (0, never NULL)."""
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


# The backlog's words, one meaning wherever they are shown (`outbox status`, the dashboard,
# the gauges; docs/concepts.md, Glossary): all come from backlog_by_topic.
STUCK_AFTER_S = 60.0  # the SLA of stuck on the dashboard and the gauges: `status --sla`'s default


class Backlog(NamedTuple):
    """One topic's backlog, as ``outbox status``, the dashboard and the gauges show it.

    - pending: rows not yet sent whose due time has come (not dead, skipped or canceled;
      a scheduled row once its deliver_at has come), blocked and stuck ones included;
    - blocked: pending rows of an ordered key with a dead message of that key before
      them (a lower seq): they wait until it is requeued or skipped (``outbox drain``
      leaves them too);
    - stuck: pending rows due for longer than the SLA (the reconciliation's word);
    - scheduled: pending rows whose deliver_at is still to come (not pending yet);
    - blocked_keys: ordered keys whose head (lowest unsettled message) is dead.
    """

    topic: str
    pending: int
    blocked: int
    stuck: int
    oldest_pending: datetime | None  # the earliest waiting_since of the pending rows
    dead: int
    blocked_keys: int
    scheduled: int
    next_due: datetime | None  # the earliest deliver_at of the scheduled rows


def backlog_by_topic(
    conn: Connection, now: datetime, sla_s: float = STUCK_AFTER_S
) -> list[Backlog]:
    """-- backlog -- per topic with pending or dead rows, by topic: the Backlog figures.
    ``now`` is the database clock (db_clock): a row is due when its deliver_at has come
    by that clock, as the scheduler's claim judges it; stuck when it was due more than
    ``sla_s`` before ``now``. One query over the pending and dead rows only (their
    partial indexes): the retained sent rows are not read."""

    due = and_(t.c.status == PENDING, is_due(now))
    late = due_time() < now - timedelta(seconds=sla_s)
    scheduled = and_(t.c.status == PENDING, t.c.deliver_at > now)  # not due yet
    query = (
        select(
            t.c.topic,
            count_if(due).label("pending"),
            count_if(and_(due, behind_dead())).label("blocked"),
            count_if(and_(due, late)).label("stuck"),
            func.min(case((due, waiting_since()))).label("oldest_pending"),
            count_if(t.c.status == DEAD).label("dead"),
            count_if(blocking_head()).label("blocked_keys"),
            count_if(scheduled).label("scheduled"),
            func.min(case((scheduled, t.c.deliver_at))).label("next_due"),
        )
        .where(pending_or_dead())  # sent rows (the retained ledger) not read
        .group_by(t.c.topic)
        .order_by(t.c.topic)
    )
    return [backlog_row(row) for row in conn.execute(query)]


def backlog_row(row: Any) -> Backlog:
    """A Backlog of a result row, the counts as ints (MariaDB's SUM is a DECIMAL)."""
    kept = ("topic", "oldest_pending", "next_due")
    values: dict[str, Any] = {k: v if k in kept else int(v) for k, v in row._mapping.items()}
    return Backlog(**values)


def settled_by_topic(conn: Connection, now: datetime) -> dict[str, dict[str, int]]:
    """-- settled -- per topic: skipped, canceled, and sent in the last minute and hour
    (``outbox status``'s other columns), by the database clock ``now``."""
    recent = sent_since(now - timedelta(hours=1))
    query = (
        select(
            t.c.topic,
            count_if(t.c.status == SKIPPED).label("skipped"),
            count_if(t.c.status == CANCELED).label("canceled"),
            count_if(sent_since(now - timedelta(minutes=1))).label("sent_1m"),
            count_if(recent).label("sent_1h"),
        )
        .where(or_(t.c.status.in_((SKIPPED, CANCELED)), recent))
        .group_by(t.c.topic)
    )
    return {row.topic: {k: int(v) for k, v in row._mapping.items() if k != "topic"}
            for row in conn.execute(query)}  # fmt: skip


def pending_or_dead() -> Any:
    """Pending or dead rows, spelled per partial index (ix_..._pending, ix_..._due,
    ix_..._dead) so that PostgreSQL reads those indexes, not the retained sent rows."""
    return or_(
        and_(t.c.status == PENDING, t.c.deliver_at.is_(None)),
        and_(t.c.status == PENDING, t.c.deliver_at.is_not(None)),
        t.c.status == DEAD,
    )


# The dashboard's reads (relay.dashboard): a few statements besides status and failures.


def sent_since(since: datetime) -> Any:
    """The rows marked sent at or after ``since`` (the sent counts of status, the
    dashboard and its charts)."""
    return and_(t.c.status == SENT, t.c.sent_at >= since)


def sent_by_topic(conn: Connection, since: datetime) -> dict[str, int]:
    """-- sent_by_topic -- per topic, the rows marked sent at or after ``since``."""
    query = select(t.c.topic, func.count()).where(sent_since(since)).group_by(t.c.topic)
    return {topic: int(n) for topic, n in conn.execute(query)}


def sent_times(conn: Connection, since: datetime, limit: int) -> list[tuple[datetime, datetime]]:
    """-- sent_times -- (created_at, sent_at) of at most ``limit`` rows sent at or after
    ``since``, the latest first: the throughput and commit->ack charts."""
    query = (
        select(t.c.created_at, t.c.sent_at)
        .where(sent_since(since))
        .order_by(t.c.sent_at.desc())
        .limit(limit)
    )
    return [(created, sent) for created, sent in conn.execute(query)]


def payload_previews(
    conn: Connection, row_ids: Sequence[int], size: int
) -> dict[int, tuple[bytes, int]]:
    """-- payload_previews -- the first ``size`` bytes of these rows' payloads and each
    payload's whole length, by row id."""
    if not row_ids:
        return {}
    head = func.substr(t.c.payload, 1, size, type_=LargeBinary())
    query = select(t.c.id, head, func.length(t.c.payload)).where(t.c.id.in_(list(row_ids)))
    return {int(i): (bytes(payload or b""), int(n)) for i, payload, n in conn.execute(query)}


class Minute(NamedTuple):
    """Sends of one minute: how many, and their created_at -> sent_at p50 and p99 (ms)."""

    minute: datetime
    sent: int
    p50_ms: float | None
    p99_ms: float | None


def sent_per_minute_pg(conn: Connection, since: datetime) -> list[Minute]:
    """-- sent_per_minute -- per minute since ``since``: sends and their commit->ack
    percentiles, computed by the database (no row travels). Only where the dialect has
    percentiles in SQL (PostgreSQL)."""
    dialect = dialect_for(conn)
    minute = dialect.minute_of(t.c.sent_at)
    latency_ms = dialect.millis_between(t.c.created_at, t.c.sent_at)
    query = (
        select(
            minute,
            func.count(),
            dialect.percentile(0.5, latency_ms),
            dialect.percentile(0.99, latency_ms),
        )
        .where(sent_since(since))
        .group_by(minute)
    )
    return [Minute(m, int(n), p50, p99) for m, n, p50, p99 in conn.execute(query)]
