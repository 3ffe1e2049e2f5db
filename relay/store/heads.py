"""Ordered heads found key by key, where the database can (PostgreSQL): a claim that
reads about what it returns however many rows each key holds.

claim_heads_stmt and claim_due_stmt look at every pending ordered row in turn and ask
whether it is its key's head: with few keys and many rows each (or a key blocked
behind a dead head), each batch read every pending ordered row. Here a loose scan of
ix_outbox_message_heads (topic, key, seq over pending and dead ordered rows) walks the
keys that have such rows, one index probe each, and takes each key's first row: its
head when pending (a dead one blocks its key). Keys are taken in (topic, key) order
from a place the caller keeps (``after``), so that no key waits behind others while
there are more heads than a batch holds.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Select, or_, select, true, tuple_

from outbox.dialects import dialect_for
from outbox.table import PENDING, outbox_message, scans_keys
from relay.store.hot import claimed_columns
from relay.store.keys import UNSETTLED

t = outbox_message

KeyAt = tuple[str, str]  # (topic, key) of an ordered key


def scans_heads(conn: Connection) -> bool:
    """Whether this database finds ordered heads key by key (ix_outbox_message_heads)."""
    return scans_keys(dialect_for(conn))


def _unsettled(rows: Any) -> list[Any]:
    """ix_outbox_message_heads' own condition: pending or dead ordered rows."""
    return [rows.c.status.in_(UNSETTLED), rows.c.seq.is_not(None)]


def _next_key(after: Any, upto: KeyAt | None, name: str) -> Select[Any]:
    """The first key past ``after`` (a (topic, key) pair of values or columns, or None:
    the first of all) that has a pending or dead ordered row, up to ``upto``: one probe."""
    u = t.alias(name)
    where = _unsettled(u)
    if after is not None:
        where.append(tuple_(u.c.topic, u.c.key) > tuple_(*after))
    if upto is not None:
        where.append(tuple_(u.c.topic, u.c.key) <= tuple_(*upto))
    return select(u.c.topic, u.c.key).where(*where).order_by(u.c.topic, u.c.key).limit(1)


def key_heads_stmt(
    cutoff: datetime,
    now: datetime,
    limit: int,
    due_only: bool = True,
    failed: Collection[int] = (),
    after: KeyAt | None = None,
    upto: KeyAt | None = None,
) -> Select[Any]:
    """-- claim_key_heads -- at most ``limit`` ordered heads older than the cutoff (and,
    with ``due_only``, not backing off), of the keys past ``after`` up to ``upto`` in
    (topic, key) order, less the ``failed``; locked (SKIP LOCKED), by id.

    A recursive CTE walks the keys (each step the next key of ix_outbox_message_heads),
    a lateral look takes each key's first pending-or-dead row: the head if it is
    pending and claimable. The recursion stops once ``limit`` heads are found. The
    lock is taken on the heads alone, by id: a head another transaction holds is
    skipped, never its key's next row (owning the head is owning the key).
    """
    keys = _next_key(after, upto, "first_key").cte("ordered_keys", recursive=True)
    step = _next_key((keys.c.topic, keys.c.key), upto, "next_key").lateral("step")
    keys = keys.union_all(select(step.c.topic, step.c.key).select_from(keys.join(step, true())))
    h = t.alias("head")
    first = (
        select(h.c.id, h.c.status, h.c.deliver_at, h.c.created_at, h.c.next_attempt_at)
        .where(h.c.topic == keys.c.topic, h.c.key == keys.c.key, *_unsettled(h))
        .order_by(h.c.seq)
        .limit(1)
        .lateral("first_row")
    )
    claimable = [first.c.status == PENDING, first.c.deliver_at.is_(None)]
    claimable.append(first.c.created_at < cutoff)
    if due_only:
        claimable.append(or_(first.c.next_attempt_at.is_(None), first.c.next_attempt_at <= now))
    if failed:
        claimable.append(first.c.id.not_in(list(failed)))
    heads = select(first.c.id).select_from(keys.join(first, true())).where(*claimable).limit(limit)
    return (
        select(*claimed_columns(limit))
        .where(t.c.id.in_(heads), t.c.status == PENDING)
        .order_by(t.c.id)
        .with_for_update(skip_locked=True, of=t)
    )
