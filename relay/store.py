"""The SQL the relay runs on its hot path, in one place.

Every state change is conditional on ``status = 'pending'``: a row that a sweeper,
an operator or another relay already finished is never changed again.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Connection,
    Delete,
    LargeBinary,
    Select,
    String,
    Update,
    Uuid,
    and_,
    bindparam,
    case,
    delete,
    func,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql

from outbox.table import DEAD, PENDING, SENT, db_now, outbox_message

t = outbox_message


# Acks name their rows by msg_id (the fast path: it holds the messages) or by row id
# (the sweeper: it claimed the rows; an int array is cheaper to build and send than a
# UUID one, and needs no text -> UUID parse per row).


def _keyed(keys: Sequence[Any], by_row_id: bool) -> tuple[Any, list[Any]]:
    """The column the keys match, and the keys as the column holds them."""
    if by_row_id:
        return t.c.id, list(keys)
    return t.c.msg_id, [uuid.UUID(str(k)) for k in keys]


def mark_sent_stmt(acks: Sequence[tuple[Any, str]], by_row_id: bool = False) -> Update:
    """-- mark_sent -- one UPDATE for a batch of (msg_id or row id, receipt) acks, any database.

    A CASE per row: its cost grows with the square of the batch, fine for the small
    batches SQLite and MariaDB see. PostgreSQL uses MARK_SENT_PG instead.
    """
    column, keys = _keyed([key for key, _ in acks], by_row_id)
    receipts = dict(zip(keys, (receipt for _, receipt in acks), strict=True))
    return (
        update(t)
        .where(column.in_(keys), t.c.status == PENDING)
        .values(status=SENT, sent_at=db_now(), receipt=case(receipts, value=column))
    )


def _mark_sent_pg(column: Any, key_type: Any) -> Update:
    """-- mark_sent (PostgreSQL) -- the receipts as two arrays joined on the key: one
    statement whatever the batch size, compiled once, linear work."""
    acked = (
        func.unnest(
            bindparam("ack_keys", type_=postgresql.ARRAY(key_type)),
            bindparam("ack_receipts", type_=postgresql.ARRAY(String())),
        )
        .table_valued("ack_key", "ack_receipt")
        .render_derived(name="acked")
    )
    return (
        update(t)
        .where(column == acked.c.ack_key, t.c.status == PENDING)
        .values(status=SENT, sent_at=db_now(), receipt=acked.c.ack_receipt)
    )


MARK_SENT_PG = {False: _mark_sent_pg(t.c.msg_id, Uuid()), True: _mark_sent_pg(t.c.id, BigInteger())}


def mark_sent(conn: Connection, acks: Sequence[tuple[Any, str]], by_row_id: bool = False) -> int:
    if conn.dialect.name != "postgresql":
        return conn.execute(mark_sent_stmt(acks, by_row_id)).rowcount
    params = {
        "ack_keys": _keyed([key for key, _ in acks], by_row_id)[1],
        "ack_receipts": [receipt for _, receipt in acks],
    }
    return conn.execute(MARK_SENT_PG[by_row_id], params).rowcount


def delete_sent_stmt(acks: Sequence[tuple[Any, str]], by_row_id: bool = False) -> Delete:
    """-- delete_sent -- the original's mode: acknowledged rows are removed at once."""
    column, keys = _keyed([key for key, _ in acks], by_row_id)
    return delete(t).where(column.in_(keys), t.c.status == PENDING)


def finish(
    conn: Connection, acks: Sequence[tuple[Any, str]], mode: str, by_row_id: bool = False
) -> int:
    """Mark (``keep``) or delete (``delete``) acknowledged rows; returns how many changed.
    Each ack is (msg_id, receipt), or (row id, receipt) with ``by_row_id``."""
    if mode == "keep":
        return mark_sent(conn, acks, by_row_id)
    return conn.execute(delete_sent_stmt(acks, by_row_id)).rowcount


def pending_among(conn: Connection, msg_ids: Sequence[str]) -> set[str]:
    """-- verify_commit -- which of these messages are committed and still pending."""
    ids = [uuid.UUID(m) for m in msg_ids]
    found = conn.execute(select(t.c.msg_id).where(t.c.msg_id.in_(ids), t.c.status == PENDING))
    return {str(m) for m in found.scalars()}


def db_clock(conn: Connection) -> datetime:
    """-- db_clock -- the database's now, in UTC: every age the relay compares is on this
    clock, whatever the session's time zone (see outbox.table.db_now)."""
    now: datetime = conn.execute(select(db_now())).scalar_one()
    return now


# A claim brings payloads up to LOAD_PAYLOAD_BYTES / limit each (so at most about 4 MiB
# in all); bigger ones are loaded afterwards, about 4 MiB per query (load_payloads):
# decoding a result of many MiB holds the GIL for tens of milliseconds, and the fast
# path shares the process.
LOAD_PAYLOAD_BYTES = 4 * 1024 * 1024
MIN_INLINE_BYTES = 1024


class Claimed(NamedTuple):
    """One claimed row, as the sweeper reads it (a tuple: attribute access on an
    SQLAlchemy Row costs about a microsecond, which adds up over a batch of 500).

    An ``outbox.rows.StoredRow``: ``outbox.rows.stored_message`` makes its Message.
    """

    id: int
    msg_id: Any  # uuid.UUID from the Uuid column
    topic: str
    key: str | None
    tags: str | None
    headers: Any  # JSON: a dict for rows send() wrote
    attempts: int
    payload: bytes | None  # None when left out by size (see load_payloads) or NULL
    size: int | None


def claim_due_stmt(
    cutoff: datetime, now: datetime, limit: int, due_only: bool = True, after_id: int | None = None
) -> Select[Any]:
    """-- claim_due -- pending rows older than the cutoff and due, oldest first, locked.

    SKIP LOCKED lets any number of sweepers run at once: each takes rows no other
    transaction holds. No id cursor: a row that commits late (a long transaction)
    is found by its created_at like any other. The columns are Claimed's; ``payload``
    is NULL when it is bigger than its share of LOAD_PAYLOAD_BYTES (``size`` says how
    big): see load_payloads.
    """
    size = func.length(t.c.payload)
    inline = max(MIN_INLINE_BYTES, LOAD_PAYLOAD_BYTES // limit)
    columns = [
        *(t.c[name] for name in Claimed._fields[:-2]),
        case((size <= inline, t.c.payload)).label("payload"),
        size.label("size"),
    ]
    due = or_(t.c.next_attempt_at.is_(None), t.c.next_attempt_at <= now) if due_only else true()
    if after_id is not None:  # a drain: each row once, in id order
        return (
            select(*columns)
            .where(t.c.status == PENDING, t.c.created_at < cutoff, t.c.id > after_id)
            .order_by(t.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
    return (
        select(*columns)
        .where(t.c.status == PENDING, t.c.created_at < cutoff, due)
        .order_by(t.c.created_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


def claim(conn: Connection, stmt: Select[Any]) -> list[Claimed]:
    return [Claimed._make(row) for row in conn.execute(stmt)]


def load_payloads(conn: Connection, rows: Sequence[Any]) -> dict[int, bytes]:
    """-- load_payloads -- the payloads a claim left out, about LOAD_PAYLOAD_BYTES per query."""
    payloads: dict[int, bytes] = {}
    for ids in payload_groups(rows):
        found = conn.execute(select(t.c.id, t.c.payload).where(t.c.id.in_(ids)))
        payloads.update((r.id, bytes(r.payload)) for r in found)
        if missing := set(ids) - payloads.keys():
            raise LookupError(f"claimed rows {sorted(missing)} not found for their payloads")
    return payloads


def payload_groups(rows: Sequence[Any]) -> Iterator[list[int]]:
    """Ids of the rows without a payload, in groups of at most LOAD_PAYLOAD_BYTES (or one row)."""
    group: list[int] = []
    group_bytes = 0
    for row in rows:
        if row.payload is not None or row.size is None:  # inline, or NULL (a planted row)
            continue
        if group and group_bytes + row.size > LOAD_PAYLOAD_BYTES:
            yield group
            group, group_bytes = [], 0
        group.append(row.id)
        group_bytes += row.size
    if group:
        yield group


def record_failures_stmt() -> Update:
    """-- record_failure -- attempts+1, last_error, next attempt time, maybe dead (executemany)."""
    return (
        update(t)
        .where(t.c.id == bindparam("row_id"), t.c.status == PENDING)
        .values(
            attempts=t.c.attempts + 1,
            last_error=bindparam("error"),
            next_attempt_at=bindparam("next_at"),
            status=bindparam("new_status"),
        )
    )


def purge_sent(conn: Connection, older_than: datetime, limit: int) -> int:
    """-- purge_sent -- delete at most ``limit`` sent rows older than ``older_than``."""
    ids = (
        conn.execute(
            select(t.c.id).where(t.c.status == SENT, t.c.sent_at < older_than).limit(limit)
        )
        .scalars()
        .all()
    )
    if not ids:
        return 0
    return conn.execute(delete(t).where(t.c.id.in_(ids), t.c.status == SENT)).rowcount


def count_if(condition: Any) -> Any:
    """How many rows of the group meet ``condition`` (0, never NULL)."""
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


def status_by_topic(conn: Connection, now: datetime) -> list[dict[str, Any]]:
    """-- status -- per topic: pending, oldest pending, dead, sent in the last minute/hour."""

    query = (
        select(
            t.c.topic,
            count_if(t.c.status == PENDING).label("pending"),
            func.min(case((t.c.status == PENDING, waiting_since()))).label("oldest_pending"),
            count_if(t.c.status == DEAD).label("dead"),
            count_if(and_(t.c.status == SENT, t.c.sent_at >= now - timedelta(minutes=1))).label(
                "sent_1m"
            ),
            count_if(and_(t.c.status == SENT, t.c.sent_at >= now - timedelta(hours=1))).label(
                "sent_1h"
            ),
        )
        .group_by(t.c.topic)
        .order_by(t.c.topic)
    )
    return [dict(row._mapping) for row in conn.execute(query)]


def waiting_since() -> Any:
    """When a pending row last became due: its requeue or its failed attempt's retry time
    (``next_attempt_at``), else its creation. An age from this does not count the time
    before a requeue, nor a backoff the relay chose (it is negative while one runs)."""
    return func.coalesce(t.c.next_attempt_at, t.c.created_at)


def backlog_by_topic(conn: Connection) -> list[Any]:
    """-- backlog -- per topic with pending or dead rows: pending, oldest waiting_since
    of the pending rows, dead. One query, for /metrics."""

    query = (
        select(
            t.c.topic,
            count_if(t.c.status == PENDING).label("pending"),
            func.min(case((t.c.status == PENDING, waiting_since()))).label("oldest_pending"),
            count_if(t.c.status == DEAD).label("dead"),
        )
        .where(t.c.status.in_((PENDING, DEAD)))  # sent rows (the retained ledger) not read
        .group_by(t.c.topic)
    )
    return list(conn.execute(query))


REQUEUE_BATCH = 1000  # rows per requeue statement: short locks, progress between batches


def requeue_conditions(dead_only: bool, topic: str | None, msg_ids: Sequence[str]) -> list[Any]:
    """Which rows a requeue takes; never pending ones.

    Only dead rows, unless msg_ids name rows explicitly (sent ones are then republished):
    a topic alone must not republish its whole retained ledger.
    """
    explicit = bool(msg_ids) and not dead_only
    conditions = [t.c.status != PENDING] if explicit else [t.c.status == DEAD]
    if topic is not None:
        conditions.append(t.c.topic == topic)
    if msg_ids:
        conditions.append(t.c.msg_id.in_([uuid.UUID(m) for m in msg_ids]))
    return conditions


def requeue_stmt(conditions: Sequence[Any]) -> Update:
    """-- requeue -- back to pending with attempts reset, the rows ``conditions`` pick."""
    return (
        update(t)
        .where(*conditions)
        .values(
            status=PENDING,
            attempts=0,
            next_attempt_at=db_now(),  # due now; an age since it waits (waiting_since)
            last_error=None,
            sent_at=None,
            receipt=None,
        )
    )


def requeue_count(
    conn: Connection, dead_only: bool, topic: str | None, msg_ids: Sequence[str]
) -> int:
    """-- requeue_count -- how many rows a requeue would take now (its progress total)."""
    conditions = requeue_conditions(dead_only, topic, msg_ids)
    return int(conn.execute(select(func.count()).where(*conditions)).scalar_one())


def requeue_batch(
    conn: Connection,
    dead_only: bool,
    topic: str | None,
    msg_ids: Sequence[str],
    after_id: int,
    size: int = REQUEUE_BATCH,
) -> tuple[int, int | None]:
    """-- requeue_batch -- requeue the next ``size`` rows past ``after_id`` (by id).

    Returns (rows requeued, the last id looked at; None when no row is left). The ids are
    selected first (MySQL takes no LIMIT in an UPDATE's subquery); the UPDATE checks the
    conditions again, so a row that changed in between is left alone and not counted.
    """
    conditions = requeue_conditions(dead_only, topic, msg_ids)
    query = select(t.c.id).where(*conditions, t.c.id > after_id).order_by(t.c.id).limit(size)
    ids = list(conn.execute(query).scalars())
    if not ids:
        return 0, None
    done = conn.execute(requeue_stmt([*conditions, t.c.id.in_(ids)])).rowcount
    return int(done), int(ids[-1])


def requeue(conn: Connection, dead_only: bool, topic: str | None, msg_ids: Sequence[str]) -> int:
    """Requeue every matching row in ``conn``'s transaction, batch by batch; how many."""
    total, after = 0, 0
    while True:
        done, last = requeue_batch(conn, dead_only, topic, msg_ids, after)
        if last is None:
            return total
        total, after = total + done, last


def unknown_ids(conn: Connection, msg_ids: Sequence[str]) -> list[str]:
    """-- unknown_ids -- those of ``msg_ids`` with no row (never written, or purged)."""
    wanted = select(t.c.msg_id).where(t.c.msg_id.in_([uuid.UUID(m) for m in msg_ids]))
    found = {str(m) for m in conn.execute(wanted).scalars()}
    return [m for m in msg_ids if m not in found]


def pending_count(conn: Connection) -> int:
    """-- pending_count -- for progress reports."""
    return int(conn.execute(select(func.count()).where(t.c.status == PENDING)).scalar_one())


FAILING = "failing"  # not a status: pending rows with a failed attempt (`outbox dead`)


class Failure(NamedTuple):
    """One row of `outbox dead`: a dead message, or a pending one whose attempts failed."""

    id: int
    msg_id: Any  # uuid.UUID
    status: str
    topic: str
    attempts: int
    created_at: datetime
    next_attempt_at: datetime | None
    last_error: str | None


def failures_stmt(
    kinds: Sequence[str], topic: str | None, limit: int, before_id: int | None
) -> Select[Any]:
    """-- failures -- dead rows and/or failing ones (pending, attempts > 0), newest first,
    ``limit`` of them with ids below ``before_id`` (the page before)."""
    chosen = []
    if DEAD in kinds:
        chosen.append(t.c.status == DEAD)
    if FAILING in kinds:
        chosen.append(and_(t.c.status == PENDING, t.c.attempts > 0))
    query = select(*(t.c[name] for name in Failure._fields)).where(or_(*chosen))
    if topic is not None:
        query = query.where(t.c.topic == topic)
    if before_id is not None:
        query = query.where(t.c.id < before_id)
    return query.order_by(t.c.id.desc()).limit(limit)


def failures(
    conn: Connection, kinds: Sequence[str], topic: str | None, limit: int, before_id: int | None
) -> list[Failure]:
    return [
        Failure._make(row) for row in conn.execute(failures_stmt(kinds, topic, limit, before_id))
    ]


def row_id_of(conn: Connection, msg_id: str) -> int | None:
    """-- row_id -- the row id of a msg_id, None when no row has it."""
    found = conn.execute(select(t.c.id).where(t.c.msg_id == uuid.UUID(msg_id))).scalar()
    return None if found is None else int(found)


def message_stmt(msg_id: str, preview_bytes: int | None) -> Select[Any]:
    """-- message -- one row by msg_id: every column, the payload's first ``preview_bytes``
    (all of it when None) as ``payload`` and its full length as ``size``."""
    payload: Any = t.c.payload
    if preview_bytes is not None:
        payload = func.substr(t.c.payload, 1, preview_bytes, type_=LargeBinary())
    columns = [c for c in t.c if c.name != "payload"]
    return select(*columns, payload.label("payload"), func.length(t.c.payload).label("size")).where(
        t.c.msg_id == uuid.UUID(msg_id)
    )


def message(conn: Connection, msg_id: str, preview_bytes: int | None) -> dict[str, Any] | None:
    """One message's row as a dict (see message_stmt), None when no row has ``msg_id``."""
    row = conn.execute(message_stmt(msg_id, preview_bytes)).one_or_none()
    return None if row is None else dict(row._mapping)
