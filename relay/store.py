"""The SQL the relay runs on its hot path, in one place.

Every state change is conditional on ``status = 'pending'``: a row that a sweeper,
an operator or another relay already finished is never changed again.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from sqlalchemy import Connection, Delete, Update, case, delete, update

from outbox.table import PENDING, SENT, db_now, outbox_message

t = outbox_message


def mark_sent_stmt(acks: Sequence[tuple[str, str]]) -> Update:
    """-- mark_sent -- one UPDATE for a batch of (msg_id, receipt) acknowledgements."""
    receipts = {uuid.UUID(msg_id): receipt for msg_id, receipt in acks}
    return (
        update(t)
        .where(t.c.msg_id.in_(list(receipts)), t.c.status == PENDING)
        .values(status=SENT, sent_at=db_now(), receipt=case(receipts, value=t.c.msg_id))
    )


def delete_sent_stmt(acks: Sequence[tuple[str, str]]) -> Delete:
    """-- delete_sent -- the original's mode: acknowledged rows are removed at once."""
    ids = [uuid.UUID(msg_id) for msg_id, _ in acks]
    return delete(t).where(t.c.msg_id.in_(ids), t.c.status == PENDING)


def finish(conn: Connection, acks: Sequence[tuple[str, str]], mode: str) -> int:
    """Mark (``keep``) or delete (``delete``) acknowledged rows; returns how many changed."""
    stmt = mark_sent_stmt(acks) if mode == "keep" else delete_sent_stmt(acks)
    return conn.execute(stmt).rowcount
