"""The SQL the relay runs on its hot path: claims, marks, failures, payloads, the purge.

Every state change is conditional on ``status = 'pending'``: a row that a sweeper,
an operator or another relay already finished is never changed again.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Iterator, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Connection,
    Delete,
    Select,
    String,
    Table,
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

from outbox.dialects import Dialect, dialect_for
from outbox.table import CANCELED, PENDING, SENT, db_now, outbox_message
from relay.store.keys import is_head, still_heads

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
    batches SQLite and MariaDB see. Where the database binds arrays (PostgreSQL),
    mark_sent_arrays instead.
    """
    column, keys = _keyed([key for key, _ in acks], by_row_id)
    receipts = dict(zip(keys, (receipt for _, receipt in acks), strict=True))
    return (
        update(t)
        .where(column.in_(keys), t.c.status == PENDING)
        .values(status=SENT, sent_at=db_now(), receipt=case(receipts, value=column))
    )


def mark_sent_arrays(dialect: Dialect) -> dict[bool, Update]:
    """-- mark_sent (arrays) -- the receipts as two arrays joined on the key: one
    statement whatever the batch size, compiled once, linear work; by msg_id (False)
    and by row id (True). Only where the dialect binds arrays (PostgreSQL)."""
    return {
        False: _mark_sent_joined(dialect, t.c.msg_id, Uuid()),
        True: _mark_sent_joined(dialect, t.c.id, BigInteger()),
    }


def _mark_sent_joined(dialect: Dialect, column: Any, key_type: Any) -> Update:
    acked = dialect.rows_of_arrays(
        "acked", [("ack_key", "ack_keys", key_type), ("ack_receipt", "ack_receipts", String())]
    )
    return (
        update(t)
        .where(column == acked.c.ack_key, t.c.status == PENDING)
        .values(status=SENT, sent_at=db_now(), receipt=acked.c.ack_receipt)
    )


def mark_sent(conn: Connection, acks: Sequence[tuple[Any, str]], by_row_id: bool = False) -> int:
    dialect = dialect_for(conn)
    if not dialect.binds_arrays:
        return conn.execute(mark_sent_stmt(acks, by_row_id)).rowcount
    params = {
        "ack_keys": _keyed([key for key, _ in acks], by_row_id)[1],
        "ack_receipts": [receipt for _, receipt in acks],
    }
    return conn.execute(dialect.built(mark_sent_arrays)[by_row_id], params).rowcount


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
    seq: int | None  # an ordered message's place in its key
    payload: bytes | None  # None when left out by size (see load_payloads) or NULL
    size: int | None


def claimed_columns(limit: int) -> list[Any]:
    """Claimed's columns; ``payload`` is NULL when it is bigger than its share of
    LOAD_PAYLOAD_BYTES in a claim of ``limit`` rows (``size`` says how big)."""
    size = func.length(t.c.payload)
    inline = max(MIN_INLINE_BYTES, LOAD_PAYLOAD_BYTES // limit)
    return [
        *(t.c[name] for name in Claimed._fields[:-2]),
        case((size <= inline, t.c.payload)).label("payload"),
        size.label("size"),
    ]


def claim_due_stmt(
    cutoff: datetime,
    now: datetime,
    limit: int,
    due_only: bool = True,
    after_id: int | None = None,
) -> Select[Any]:
    """-- claim_due -- pending rows older than the cutoff and due, oldest first, locked;
    of an ordered key only its head (see is_head), so a blocked key's rows never fill it.

    SKIP LOCKED lets any number of sweepers run at once: each takes rows no other
    transaction holds; owning a key's head is owning the key. No id cursor: a row that
    commits late (a long transaction) is found by its created_at like any other.

    A drain (``after_id``) takes each unordered row once, in id order, here; the ordered
    heads apart (claim_heads_stmt). One range of ix_outbox_message_unordered (or, on
    MySQL/MariaDB, ix_outbox_message_claimable) from ``after_id``: each batch reads about
    what it returns, whatever the backlog behind it.
    """
    columns = claimed_columns(limit)
    # deliver_at IS NULL: scheduled rows are the scheduler's; and it lets PostgreSQL and
    # SQLite use ix_outbox_message_pending, which leaves them out.
    claimable = [t.c.status == PENDING, t.c.deliver_at.is_(None), t.c.created_at < cutoff]
    if after_id is not None:
        return (
            select(*columns)
            .where(*claimable, t.c.seq.is_(None), t.c.id > after_id)
            .order_by(t.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
    due = or_(t.c.next_attempt_at.is_(None), t.c.next_attempt_at <= now) if due_only else true()
    return (
        select(*columns)
        .where(*claimable, is_head(), due)
        .order_by(t.c.created_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


def claim_aged_stmt(cutoff: datetime, limit: int) -> Select[Any]:
    """-- claim_aged -- the sweeper's unordered rows never tried, older than the cutoff,
    oldest first, locked; where the claims scan keys (relay.store.heads), beside its
    ordered heads and its retries. One range of ix_outbox_message_unordered_age: no
    ordered row (a blocked one) and no row backing off is in it."""
    return (
        select(*claimed_columns(limit))
        .where(t.c.status == PENDING, t.c.deliver_at.is_(None), t.c.seq.is_(None))
        .where(t.c.next_attempt_at.is_(None), t.c.created_at < cutoff)
        .order_by(t.c.created_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


def claim_retries_stmt(
    cutoff: datetime, now: datetime, limit: int, due_only: bool = True
) -> Select[Any]:
    """-- claim_retries -- the sweeper's unordered rows tried before (a failure's backoff,
    a requeue) and older than the cutoff, due by ``now`` unless not ``due_only``, the
    earliest due first, locked. One range of ix_outbox_message_retry: rows still backing
    off lie past ``now`` and are not read."""
    retried = [t.c.next_attempt_at.is_not(None), t.c.created_at < cutoff]
    if due_only:
        retried.append(t.c.next_attempt_at <= now)
    return (
        select(*claimed_columns(limit))
        .where(t.c.status == PENDING, t.c.deliver_at.is_(None), t.c.seq.is_(None), *retried)
        .order_by(t.c.next_attempt_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


def claim_heads_stmt(cutoff: datetime, limit: int, failed: Collection[int] = ()) -> Select[Any]:
    """-- claim_heads -- a drain's ordered heads older than the cutoff, whatever their id
    (a row became its key's head when the one before it was sent, maybe after the drain's
    cursor passed it), less the ``failed`` of this drain pass; by id, locked. Reads the
    pending ordered rows only (ix_outbox_message_ordered, or ix_outbox_message_claimable):
    nothing when the backlog is unordered.
    """
    ordered = [t.c.seq.is_not(None), is_head()]
    if failed:
        ordered.append(t.c.id.not_in(list(failed)))
    return (
        select(*claimed_columns(limit))
        .where(t.c.status == PENDING, t.c.deliver_at.is_(None), t.c.created_at < cutoff, *ordered)
        .order_by(t.c.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


def claim(conn: Connection, stmt: Select[Any]) -> list[Claimed]:
    """The rows ``stmt`` (claim_due_stmt) locks, less the ordered ones a fresh look finds
    are no longer their key's head (only where the claim's own look may be stale)."""
    rows = [Claimed._make(row) for row in conn.execute(stmt)]
    if not dialect_for(conn).stale_locking_reads:
        return rows
    ordered = [row.id for row in rows if row.seq is not None]
    if not ordered:
        return rows
    heads = still_heads(conn, ordered)
    return [row for row in rows if row.seq is None or row.id in heads]


def followers_stmt(
    heads: Sequence[Claimed], cutoff: datetime, per_key: int, limit: int
) -> Select[Any]:
    """-- followers -- the next ``per_key`` rows of each head's key, by seq, pending,
    older than the cutoff, locked; those another transaction holds are skipped (a gap:
    see followers). The heads are this transaction's, so no other publisher has their keys.
    """
    ranges = [
        and_(t.c.topic == h.topic, t.c.key == h.key, t.c.seq.between(h.seq + 1, h.seq + per_key))
        for h in heads
        if h.seq is not None
    ]
    return (
        select(*claimed_columns(limit))
        .where(or_(*ranges), t.c.status == PENDING, t.c.created_at < cutoff)
        .with_for_update(skip_locked=True)
    )


def followers(
    conn: Connection, heads: Sequence[Claimed], cutoff: datetime, room: int, limit: int
) -> list[Claimed]:
    """The rows that follow the claimed ordered ``heads`` without a gap, at most ``room``
    in all (shared evenly by the keys), in seq order per key. A gap is a row that is
    not pending, too young or locked elsewhere: the key's rows stop before it."""
    ordered = [h for h in heads if h.seq is not None]
    per_key = room // len(ordered) if ordered else 0
    if per_key == 0:
        return []
    found = conn.execute(followers_stmt(ordered, cutoff, per_key, limit))
    by_key: dict[tuple[str, str | None], dict[int, Claimed]] = {}
    for row in map(Claimed._make, found):
        by_key.setdefault((row.topic, row.key), {})[row.seq or 0] = row
    taken: list[Claimed] = []
    for head in ordered:
        rows, seq = by_key.get((head.topic, head.key), {}), (head.seq or 0) + 1
        while seq in rows:
            taken.append(rows.pop(seq))
            seq += 1
    return taken


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


def purge_sent(conn: Connection, older_than: datetime, limit: int, table: Table = t) -> int:
    """-- purge_sent -- delete at most ``limit`` settled rows older than ``older_than``:
    sent ones by ``sent_at``, canceled ones by ``created_at`` (their dedup_key is free
    again once they are gone). ``table``: a partition (outbox.partitions.default_table).

    Sent rows, then canceled ones, each by a read of its own: each reads its own index
    range (sent rows by sent_at), where one OR of both read every sent row on MariaDB."""
    sent = and_(table.c.status == SENT, table.c.sent_at < older_than)
    canceled = and_(table.c.status == CANCELED, table.c.created_at < older_than)
    ids = list(conn.execute(select(table.c.id).where(sent).limit(limit)).scalars())
    if len(ids) < limit:
        more = select(table.c.id).where(canceled).limit(limit - len(ids))
        ids += conn.execute(more).scalars()
    if not ids:
        return 0
    return conn.execute(delete(table).where(table.c.id.in_(ids), or_(sent, canceled))).rowcount
