"""The operator's reads and actions (`outbox requeue`, `skip`, `dead`, `show`, `delete`,
the dashboard's buttons): each change is conditional on the status the row must have."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    Connection,
    LargeBinary,
    Select,
    Update,
    and_,
    case,
    delete,
    func,
    or_,
    select,
    update,
)

from outbox.table import CANCELED, DEAD, PENDING, SENT, SKIPPED, db_now, outbox_message
from relay.store.keys import UNSETTLED, blocking_head, earlier_unsettled, held_behind

t = outbox_message

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


def delete_dead(conn: Connection, msg_id: str) -> bool:
    """-- delete_dead -- delete one message if it is dead; whether it was (any other
    status is left alone: a dead letter is the one row an operator may throw away)."""
    gone = delete(t).where(t.c.msg_id == uuid.UUID(msg_id), t.c.status == DEAD)
    return bool(conn.execute(gone).rowcount)


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
