"""Scheduled messages (a deliver_at): the scheduler's claim and clock, and when a row is due."""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    Connection,
    Select,
    case,
    func,
    or_,
    select,
)

from outbox.table import PENDING, db_now, outbox_message
from relay.store.hot import claimed_columns

t = outbox_message


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


def is_due(now: datetime) -> Any:
    """The row may go now: unscheduled, or its deliver_at has come (by the database clock
    ``now``). A scheduled row not due yet is no backlog: it waits for its time."""
    return or_(t.c.deliver_at.is_(None), t.c.deliver_at <= now)


def due_time() -> Any:
    """When the row was first due: its deliver_at if later than its creation, else its
    creation (as the reconciliation's SLA counts)."""
    return case((t.c.deliver_at > t.c.created_at, t.c.deliver_at), else_=t.c.created_at)


def waiting_since() -> Any:
    """When a pending row last became due: its requeue or its failed attempt's retry time
    (``next_attempt_at``), else its deliver_at for a scheduled row (a past one given at
    send: its creation), else its creation. An age from this does not count the time
    before a requeue or a message's schedule, nor a backoff the relay chose (it is
    negative while one runs)."""
    return func.coalesce(t.c.next_attempt_at, due_time())
