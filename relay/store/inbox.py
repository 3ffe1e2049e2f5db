"""The consumers' inboxes (outbox_inbox) as an operator sees them: dead letters, requeue."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import Connection, and_, func, select, update

from outbox.table import DEAD, REQUEUED, inbox_message

t = inbox_message


class DeadLetter(NamedTuple):
    msg_id: uuid.UUID
    topic: str
    attempts: int
    created_at: datetime
    last_error: str | None


def dead_letters(
    conn: Connection, consumer: str, topic: str | None, limit: int
) -> list[DeadLetter]:
    """-- inbox_dead -- a consumer's dead letters, newest first."""
    query = (
        select(t.c.msg_id, t.c.topic, t.c.attempts, t.c.created_at, t.c.last_error)
        .where(t.c.consumer == consumer, t.c.status == DEAD)
        .order_by(t.c.created_at.desc())
        .limit(limit)
    )
    if topic is not None:
        query = query.where(t.c.topic == topic)
    return [DeadLetter(*row) for row in conn.execute(query)]


def requeue_dead_letters(
    conn: Connection, consumer: str, topic: str | None, msg_ids: Sequence[uuid.UUID]
) -> int:
    """-- inbox_requeue -- give a consumer's dead letters back (all, of ``topic``, or
    those of ``msg_ids``): its runner runs them again from the table."""
    chosen = [t.c.consumer == consumer, t.c.status == DEAD]
    if topic is not None:
        chosen.append(t.c.topic == topic)
    if msg_ids:
        chosen.append(t.c.msg_id.in_(msg_ids))
    return conn.execute(update(t).where(and_(*chosen)).values(status=REQUEUED)).rowcount


def consumers(conn: Connection) -> dict[str, dict[str, int]]:
    """-- inbox_counts -- rows per consumer and status."""
    query = select(t.c.consumer, t.c.status, func.count()).group_by(t.c.consumer, t.c.status)
    counts: dict[str, dict[str, int]] = {}
    for consumer, status, n in conn.execute(query):
        counts.setdefault(consumer, {})[status] = n
    return counts
