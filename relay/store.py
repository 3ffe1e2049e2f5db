"""The SQL the relay runs on its hot path, in one place.

Every state change is conditional on ``status = 'pending'``: a row that a sweeper,
an operator or another relay already finished is never changed again.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Iterator, Sequence
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

from outbox.table import CANCELED, DEAD, PENDING, SENT, SKIPPED, db_now, outbox_message

t = outbox_message
# The statuses that hold an ordered key: a message not settled yet (sent or skipped are).
UNSETTLED = (PENDING, DEAD)


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


Head = tuple[str, str, int]  # (topic, key, seq) of an ordered message


def blocked_keys(conn: Connection, heads: Sequence[Head]) -> set[tuple[str, str]]:
    """-- blocked_keys -- the (topic, key) of those heads that must wait: a row of the same
    key with a lower seq is pending or dead (not yet acked, or given up but not skipped).

    One statement for the batch, each head a range of ix_outbox_message_key_seq. Run it
    alone, in a snapshot taken after the heads committed (a new transaction): a head
    visible there has its predecessors visible too (seq order is commit order). Never
    inside a SKIP LOCKED claim, which may pass over a locked predecessor.
    """
    if not heads:
        return set()
    if conn.dialect.name == "postgresql":
        topics, keys, seqs = (list(column) for column in zip(*heads, strict=True))
        params = {"head_topics": topics, "head_keys": keys, "head_seqs": seqs}
        return {(topic, key) for topic, key in conn.execute(BLOCKED_KEYS_PG, params)}
    earlier = or_(
        *(and_(t.c.topic == topic, t.c.key == key, t.c.seq < seq) for topic, key, seq in heads)
    )
    query = select(t.c.topic, t.c.key).where(earlier, t.c.status.in_(UNSETTLED)).distinct()
    return {(topic, key) for topic, key in conn.execute(query)}


def _blocked_keys_pg() -> Select[Any]:
    """blocked_keys on PostgreSQL: the heads as three arrays, one statement compiled once
    (an OR per head is a new statement, compiled anew, for every batch size)."""
    head = (
        func.unnest(
            bindparam("head_topics", type_=postgresql.ARRAY(String())),
            bindparam("head_keys", type_=postgresql.ARRAY(String())),
            bindparam("head_seqs", type_=postgresql.ARRAY(BigInteger())),
        )
        .table_valued("topic", "key", "seq")
        .render_derived(name="head")
    )
    earlier = select(t.c.id).where(
        t.c.topic == head.c.topic,
        t.c.key == head.c.key,
        t.c.status.in_(UNSETTLED),
        t.c.seq.is_not(None),  # the index's own condition
        t.c.seq < head.c.seq,
    )
    return select(head.c.topic, head.c.key).where(earlier.exists()).distinct()


BLOCKED_KEYS_PG = _blocked_keys_pg()


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


def is_head(row: Any = t) -> Any:
    """Whether an ordered row may be published: no earlier row of its (topic, key) is
    pending or dead (the others are sent, skipped or purged). Unordered rows always may.

    Two short ranges of ix_outbox_message_key_seq (topic, key, status, seq): the key's
    retained sent rows are never read.
    """
    prior = t.alias("prior")
    earlier = (
        select(prior.c.id)
        .where(
            prior.c.topic == row.c.topic,
            prior.c.key == row.c.key,
            prior.c.status.in_((PENDING, DEAD)),
            prior.c.seq.is_not(None),  # the index's own condition
            prior.c.seq < row.c.seq,
        )
        .correlate(row)
    )
    return or_(row.c.seq.is_(None), ~earlier.exists())


def claim_due_stmt(
    cutoff: datetime,
    now: datetime,
    limit: int,
    due_only: bool = True,
    after_id: int | None = None,
    failed: Collection[int] = (),
) -> Select[Any]:
    """-- claim_due -- pending rows older than the cutoff and due, oldest first, locked;
    of an ordered key only its head (see is_head), so a blocked key's rows never fill it.

    SKIP LOCKED lets any number of sweepers run at once: each takes rows no other
    transaction holds; owning a key's head is owning the key. No id cursor: a row that
    commits late (a long transaction) is found by its created_at like any other.

    A drain (``after_id``) takes each unordered row once, in id order; an ordered head
    whatever its id (it became the head when the row before it was sent, maybe after the
    cursor passed it) unless it is among the ``failed`` of this drain pass.
    """
    columns = claimed_columns(limit)
    # deliver_at IS NULL: scheduled rows are the scheduler's; and it lets PostgreSQL and
    # SQLite use ix_outbox_message_pending, which leaves them out.
    pending = [t.c.status == PENDING, t.c.deliver_at.is_(None), t.c.created_at < cutoff, is_head()]
    if after_id is not None:
        unordered = and_(t.c.seq.is_(None), t.c.id > after_id)
        ordered: Any = t.c.seq.is_not(None)
        if failed:
            ordered = and_(ordered, t.c.id.not_in(list(failed)))
        return (
            select(*columns)
            .where(*pending, or_(unordered, ordered))
            .order_by(t.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
    due = or_(t.c.next_attempt_at.is_(None), t.c.next_attempt_at <= now) if due_only else true()
    return (
        select(*columns)
        .where(*pending, due)
        .order_by(t.c.created_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


def scheduled() -> list[Any]:
    """A pending scheduled row: the conditions of ix_outbox_message_due (partial on
    PostgreSQL and SQLite; status first on MariaDB)."""
    return [t.c.status == PENDING, t.c.deliver_at.is_not(None)]


def claim_scheduled_stmt(now: datetime, limit: int) -> Select[Any]:
    """-- claim_scheduled -- scheduled rows due by ``now`` (the database clock, read in
    the claiming transaction: never early) and not backing off, earliest first, locked;
    SKIP LOCKED shares them among any number of schedulers. A range of
    ix_outbox_message_due, read in its order."""
    backoff_over = or_(t.c.next_attempt_at.is_(None), t.c.next_attempt_at <= now)
    return (
        select(*claimed_columns(limit))
        .where(*scheduled(), t.c.deliver_at <= now, backoff_over)
        .order_by(t.c.deliver_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


class NextDue(NamedTuple):
    """The database clock and the earliest scheduled row due after it (None: none)."""

    now: datetime
    next_due: datetime | None


def next_due_stmt() -> Select[Any]:
    """-- next_due -- the database's now and the earliest due time after it, in one
    statement (one clock reading for both). The first entry of ix_outbox_message_due's
    range past now: rows already due (claimed, locked elsewhere, backing off) are not
    read, so a row another scheduler holds does not make this one spin."""
    now = db_now()
    later = select(func.min(t.c.deliver_at)).where(*scheduled(), t.c.deliver_at > now)
    return select(now.label("now"), later.scalar_subquery().label("next_due"))


def next_due(conn: Connection) -> NextDue:
    row = conn.execute(next_due_stmt()).one()
    return NextDue(row.now, row.next_due)


def scheduled_count(conn: Connection) -> int:
    """-- scheduled_count -- pending scheduled rows not due yet by the database clock."""
    query = select(func.count()).where(*scheduled(), t.c.deliver_at > db_now())
    return int(conn.execute(query).scalar_one())


def claim(conn: Connection, stmt: Select[Any]) -> list[Claimed]:
    """The rows ``stmt`` (claim_due_stmt) locks, less the ordered ones a fresh look finds
    are no longer their key's head (only where the claim's own look may be stale)."""
    rows = [Claimed._make(row) for row in conn.execute(stmt)]
    if conn.dialect.name not in ("mysql", "mariadb"):
        return rows
    ordered = [row.id for row in rows if row.seq is not None]
    if not ordered:
        return rows
    heads = still_heads(conn, ordered)
    return [row for row in rows if row.seq is None or row.id in heads]


def still_heads(conn: Connection, row_ids: Sequence[int]) -> set[int]:
    """-- still_heads -- which of these ordered rows are their key's head now.

    InnoDB reads the subquery of a locking statement in a snapshot that may predate the
    rows it locked (a predecessor committed just before its follower is then unseen):
    this separate statement, at READ COMMITTED (the sweeper's, see relay.sweep.sweeper), sees
    every row committed before the claim, so each locked row's predecessors.
    """
    found = conn.execute(select(t.c.id).where(t.c.id.in_(list(row_ids)), is_head()))
    return set(found.scalars())


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


def purge_sent(conn: Connection, older_than: datetime, limit: int) -> int:
    """-- purge_sent -- delete at most ``limit`` settled rows older than ``older_than``:
    sent ones by ``sent_at``, canceled ones by ``created_at`` (their dedup_key is free
    again once they are gone)."""
    old = or_(
        and_(t.c.status == SENT, t.c.sent_at < older_than),
        and_(t.c.status == CANCELED, t.c.created_at < older_than),
    )
    ids = conn.execute(select(t.c.id).where(old).limit(limit)).scalars().all()
    if not ids:
        return 0
    return conn.execute(delete(t).where(t.c.id.in_(ids), old)).rowcount


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
    minute, hour = now - timedelta(minutes=1), now - timedelta(hours=1)
    recent = and_(t.c.status == SENT, t.c.sent_at >= hour)
    query = (
        select(
            t.c.topic,
            count_if(t.c.status == SKIPPED).label("skipped"),
            count_if(t.c.status == CANCELED).label("canceled"),
            count_if(and_(t.c.status == SENT, t.c.sent_at >= minute)).label("sent_1m"),
            count_if(recent).label("sent_1h"),
        )
        .where(or_(t.c.status.in_((SKIPPED, CANCELED)), recent))
        .group_by(t.c.topic)
    )
    return {row.topic: {k: int(v) for k, v in row._mapping.items() if k != "topic"}
            for row in conn.execute(query)}  # fmt: skip


def is_due(now: datetime) -> Any:
    """The row may go now: unscheduled, or its deliver_at has come (by the database clock
    ``now``). A scheduled row not due yet is no backlog: it waits for its time."""
    return or_(t.c.deliver_at.is_(None), t.c.deliver_at <= now)


def blocking_head() -> Any:
    """The row is a dead ordered message at the head of its key (is_head): the key's later
    messages wait for it, until `outbox requeue` or `outbox skip`. Cheap conditions
    first: the subquery runs for dead ordered rows only."""
    return and_(t.c.status == DEAD, t.c.seq.is_not(None), is_head())


def behind_dead(row: Any = t) -> Any:
    """The ordered row has a dead message of its key before it (a lower seq): it is
    blocked, waiting until that one is requeued or skipped. The subquery is a short
    range of ix_outbox_message_key_seq (topic, key, status, seq), for ordered rows only."""
    prior = t.alias("prior")
    earlier_dead = (
        select(prior.c.id)
        .where(
            prior.c.topic == row.c.topic,
            prior.c.key == row.c.key,
            prior.c.status == DEAD,
            prior.c.seq.is_not(None),  # the index's own condition
            prior.c.seq < row.c.seq,
        )
        .correlate(row)
    )
    return and_(row.c.seq.is_not(None), earlier_dead.exists())


def held_behind() -> Any:
    """How many messages of the row's key after it are unsettled (held while it blocks)."""
    later = t.alias("later")
    return (
        select(func.count())
        .where(
            later.c.topic == t.c.topic,
            later.c.key == t.c.key,
            later.c.status.in_(UNSETTLED),
            later.c.seq.is_not(None),  # the index's own condition
            later.c.seq > t.c.seq,
        )
        .scalar_subquery()
    )


class BlockedKey(NamedTuple):
    """A key whose head (lowest unsettled seq) is dead: `outbox status`'s blocked keys."""

    topic: str
    key: str
    msg_id: Any  # uuid.UUID: the head's
    seq: int
    behind: int  # unsettled messages of the key after the head
    created_at: datetime  # the head's


def dead_heads(conn: Connection, limit: int) -> list[BlockedKey]:
    """-- dead_heads -- at most ``limit`` blocked keys, the oldest head first."""
    query = (
        select(t.c.topic, t.c.key, t.c.msg_id, t.c.seq, held_behind(), t.c.created_at)
        .where(blocking_head())
        .order_by(t.c.created_at, t.c.id)
        .limit(limit)
    )
    return [BlockedKey._make(row) for row in conn.execute(query)]


def waiting_since() -> Any:
    """When a pending row last became due: its requeue or its failed attempt's retry time
    (``next_attempt_at``), else its deliver_at for a scheduled row (a past one given at
    send: its creation), else its creation. An age from this does not count the time
    before a requeue or a message's schedule, nor a backoff the relay chose (it is
    negative while one runs)."""
    return func.coalesce(t.c.next_attempt_at, due_time())


def due_time() -> Any:
    """When the row was first due: its deliver_at if later than its creation, else its
    creation (as the reconciliation's SLA counts)."""
    return case((t.c.deliver_at > t.c.created_at, t.c.deliver_at), else_=t.c.created_at)


def pending_or_dead() -> Any:
    """Pending or dead rows, spelled per partial index (ix_..._pending, ix_..._due,
    ix_..._dead) so that PostgreSQL reads those indexes, not the retained sent rows."""
    return or_(
        and_(t.c.status == PENDING, t.c.deliver_at.is_(None)),
        and_(t.c.status == PENDING, t.c.deliver_at.is_not(None)),
        t.c.status == DEAD,
    )


REQUEUE_BATCH = 1000  # rows per requeue statement: short locks, progress between batches


def requeue_conditions(dead_only: bool, topic: str | None, msg_ids: Sequence[str]) -> list[Any]:
    """Which rows a requeue takes; never pending ones.

    Only dead rows, unless msg_ids name rows explicitly (sent ones are then republished):
    a topic alone must not republish its whole retained ledger.
    """
    explicit = bool(msg_ids) and not dead_only
    # Never a canceled one: its cancel promised the app it would not go out.
    settled = [t.c.status != PENDING, t.c.status != CANCELED]
    conditions = settled if explicit else [t.c.status == DEAD]
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


class SkipOutcome(NamedTuple):
    """What `outbox skip` did to one msg_id."""

    msg_id: str
    outcome: str  # skipped, already_sent, already_skipped or unknown (no row)
    was: str | None  # the status it had, None when no row
    topic: str | None
    key: str | None
    seq: int | None  # an ordered message's place in its key
    held_by_earlier: bool  # ordered, and an earlier message of its key is still unsettled


def skip(conn: Connection, msg_ids: Sequence[str]) -> list[SkipOutcome]:
    """-- skip -- the pending or dead ones of ``msg_ids`` become skipped, in ``conn``'s
    transaction; an outcome per msg_id, in the order given.

    One plain UPDATE per row under the status condition, in id order (two skips never
    deadlock each other): it waits for a sweeper or relay holding the row, and leaves
    alone a row that became sent meanwhile. Sent rows are never skipped: they reached
    the broker.
    """
    wanted = [uuid.UUID(m) for m in msg_ids]
    columns = (t.c.id, t.c.msg_id, t.c.status, t.c.topic, t.c.key, t.c.seq)
    rows = conn.execute(select(*columns).where(t.c.msg_id.in_(wanted)).order_by(t.c.id)).all()
    found = {str(row.msg_id): skip_row(conn, row) for row in rows}
    unknown = SkipOutcome("", "unknown", None, None, None, None, False)
    return [found.get(m) or unknown._replace(msg_id=m) for m in map(str, wanted)]


def skip_row(conn: Connection, row: Any) -> SkipOutcome:
    """Skip one row read by ``skip`` if it is still pending or dead."""
    changed = conn.execute(
        update(t).where(t.c.id == row.id, t.c.status.in_(UNSETTLED)).values(status=SKIPPED)
    ).rowcount
    if changed:
        held = row.seq is not None and earlier_unsettled(conn, row)
        return skip_outcome(row, "skipped", row.status, held)
    now = current_status(conn, row.id)
    status = SENT if now is None else now.status  # no row now: deleted once sent (delete mode)
    return skip_outcome(row, f"already_{status}", status)


def skip_outcome(row: Any, outcome: str, was: str, held: bool = False) -> SkipOutcome:
    return SkipOutcome(str(row.msg_id), outcome, was, row.topic, row.key, row.seq, held)


def current_status(conn: Connection, row_id: int) -> Any:
    """-- current_status -- a row's status as committed now: a locking read (InnoDB's
    REPEATABLE READ would answer from the transaction's snapshot otherwise)."""
    query = select(t.c.status).where(t.c.id == row_id).with_for_update()
    return conn.execute(query).one_or_none()


def earlier_unsettled(conn: Connection, row: Any) -> bool:
    """-- earlier_unsettled -- an earlier message of the row's key is pending or dead."""
    query = select(t.c.id).where(
        t.c.topic == row.topic,
        t.c.key == row.key,
        t.c.status.in_(UNSETTLED),
        t.c.seq.is_not(None),  # the index's own condition
        t.c.seq < row.seq,
    )
    return conn.execute(query.limit(1)).first() is not None


class Overtaken(NamedTuple):
    """An ordered message a later message of its key was delivered before."""

    msg_id: Any  # uuid.UUID
    topic: str
    key: str
    seq: int
    delivered_seq: int  # the highest seq of its key marked sent


def overtaken(conn: Connection, msg_ids: Sequence[str]) -> list[Overtaken]:
    """-- overtaken -- of ``msg_ids``, the ordered ones whose key has a higher seq sent:
    requeued, they would reach the broker after it (out of order)."""
    m, later = t.alias("m"), t.alias("later")
    after = and_(
        later.c.topic == m.c.topic,
        later.c.key == m.c.key,
        later.c.status == SENT,
        later.c.seq > m.c.seq,
    )
    query = (
        select(m.c.msg_id, m.c.topic, m.c.key, m.c.seq, func.max(later.c.seq))
        .join(later, after)
        .where(m.c.msg_id.in_([uuid.UUID(i) for i in msg_ids]), m.c.seq.is_not(None))
        .group_by(m.c.msg_id, m.c.topic, m.c.key, m.c.seq)
    )
    return [Overtaken._make(row) for row in conn.execute(query)]


def unknown_ids(conn: Connection, msg_ids: Sequence[str]) -> list[str]:
    """-- unknown_ids -- those of ``msg_ids`` with no row (never written, or purged)."""
    wanted = select(t.c.msg_id).where(t.c.msg_id.in_([uuid.UUID(m) for m in msg_ids]))
    found = {str(m) for m in conn.execute(wanted).scalars()}
    return [m for m in msg_ids if m not in found]


def pending_count(conn: Connection) -> int:
    """-- pending_count -- for progress reports."""
    return sum(  # one count per partial index (PostgreSQL, SQLite): each an index scan
        int(conn.execute(select(func.count()).where(t.c.status == PENDING, part)).scalar_one())
        for part in (t.c.deliver_at.is_(None), t.c.deliver_at.is_not(None))
    )


FAILING = "failing"  # not a status: pending rows with a failed attempt (`outbox dead`)


class Failure(NamedTuple):
    """One row of `outbox dead`: a dead message, or a pending one whose attempts failed."""

    id: int
    msg_id: Any  # uuid.UUID
    status: str
    topic: str
    key: str | None
    seq: int | None  # an ordered message's place in its key
    attempts: int
    created_at: datetime
    next_attempt_at: datetime | None
    last_error: str | None
    blocks_behind: int | None  # a dead ordered head: the messages of its key it holds


def failures_stmt(
    kinds: Sequence[str], topic: str | None, limit: int, before_id: int | None
) -> Select[Any]:
    """-- failures -- dead rows and/or failing ones (pending, attempts > 0), newest first,
    ``limit`` of them with ids below ``before_id`` (the page before); a dead ordered
    head says how many messages of its key it holds."""
    chosen = []
    if DEAD in kinds:
        chosen.append(t.c.status == DEAD)
    if FAILING in kinds:
        # Spelled per partial index (ix_..._pending, ix_..._due) so that both can serve it.
        for part in (t.c.deliver_at.is_(None), t.c.deliver_at.is_not(None)):
            chosen.append(and_(t.c.status == PENDING, part, t.c.attempts > 0))
    blocks = case((blocking_head(), held_behind())).label("blocks_behind")
    query = select(*(t.c[name] for name in Failure._fields[:-1]), blocks).where(or_(*chosen))
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


# The dashboard's reads (relay.dashboard): a few statements besides status and failures.


def sent_by_topic(conn: Connection, since: datetime) -> dict[str, int]:
    """-- sent_by_topic -- per topic, the rows marked sent at or after ``since``."""
    query = (
        select(t.c.topic, func.count())
        .where(t.c.status == SENT, t.c.sent_at >= since)
        .group_by(t.c.topic)
    )
    return {topic: int(n) for topic, n in conn.execute(query)}


def sent_times(conn: Connection, since: datetime, limit: int) -> list[tuple[datetime, datetime]]:
    """-- sent_times -- (created_at, sent_at) of at most ``limit`` rows sent at or after
    ``since``, the latest first: the throughput and commit->ack charts."""
    query = (
        select(t.c.created_at, t.c.sent_at)
        .where(t.c.status == SENT, t.c.sent_at >= since)
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


def delete_dead(conn: Connection, msg_id: str) -> bool:
    """-- delete_dead -- delete one message if it is dead; whether it was (any other
    status is left alone: a dead letter is the one row an operator may throw away)."""
    gone = delete(t).where(t.c.msg_id == uuid.UUID(msg_id), t.c.status == DEAD)
    return bool(conn.execute(gone).rowcount)


class Minute(NamedTuple):
    """Sends of one minute: how many, and their created_at -> sent_at p50 and p99 (ms)."""

    minute: datetime
    sent: int
    p50_ms: float | None
    p99_ms: float | None


def sent_per_minute_pg(conn: Connection, since: datetime) -> list[Minute]:
    """-- sent_per_minute -- (PostgreSQL) per minute since ``since``: sends and their
    commit->ack percentiles, computed by the database (no row travels)."""
    minute = func.date_trunc("minute", t.c.sent_at)
    latency_ms = func.extract("epoch", t.c.sent_at - t.c.created_at) * 1000
    query = (
        select(
            minute,
            func.count(),
            func.percentile_cont(0.5).within_group(latency_ms),
            func.percentile_cont(0.99).within_group(latency_ms),
        )
        .where(t.c.status == SENT, t.c.sent_at >= since)
        .group_by(minute)
    )
    return [Minute(m, int(n), p50, p99) for m, n, p50, p99 in conn.execute(query)]
