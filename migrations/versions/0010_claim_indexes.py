"""Indexes for the sweeper's, the scheduler's and the ordered heads' claims: pending
unordered rows by age or by retry time, pending scheduled rows by due time, and pending
or dead ordered rows by (topic, key, seq).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28

The sweeper took the pending rows by created_at (ix_outbox_message_pending) and asked of
each ordered one whether it was its key's head; the drain's heads' claim asked the same
of every pending ordered row by id. A key blocked behind a dead head, or a few keys with
many rows each, made every batch read all of their rows (100,000 ordered rows in 10
keys: 0.56 s a batch, for 500 rows or none). Where the claims scan keys (partial indexes
and SKIP LOCKED: PostgreSQL), partial indexes: ix_outbox_message_unordered_age on
(created_at) over pending unscheduled unordered rows never tried (the sweeper's rows by
age, with no ordered row and no row backing off in the way: those waiting out a backoff
were read by every batch too), ix_outbox_message_retry on (next_attempt_at) over the
tried ones (the due ones a range), ix_outbox_message_heads on (topic, key, seq) over pending and
dead ordered rows (a loose scan walks the keys; a key's first entry is its head, or the
dead row that blocks it), ix_outbox_message_due_at on (deliver_at) over pending
scheduled rows (with statistics taken before many scheduled rows were sent, the
scheduler's claim went by ix_outbox_message_scheduled, which holds the sent ones too:
30,500 rows read for 500). On MySQL/MariaDB, whose ix_outbox_message_pending holds every
row, the sweeper read the retained ledger and the scheduled rows older than its rows
each batch (200,500 rows for 500 beside 100,000 sent and 100,000 scheduled ones):
ix_outbox_message_pending_age on (status, deliver_at, created_at) picks its rows by its
leading columns. Building them on a big table blocks writes to it for the time they
take (seconds per million rows).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.dialects import dialect_for

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

UNORDERED = "status = 'pending' AND deliver_at IS NULL AND seq IS NULL"
INDEXES = {
    "ix_outbox_message_unordered_age": (["created_at"], f"{UNORDERED} AND next_attempt_at IS NULL"),
    "ix_outbox_message_retry": (
        ["next_attempt_at"],
        f"{UNORDERED} AND next_attempt_at IS NOT NULL",
    ),
    "ix_outbox_message_due_at": (["deliver_at"], "status = 'pending' AND deliver_at IS NOT NULL"),
    "ix_outbox_message_heads": (
        ["topic", "key", "seq"],
        "status IN ('pending', 'dead') AND seq IS NOT NULL",
    ),
}


WHOLE = ("ix_outbox_message_pending_age", ["status", "deliver_at", "created_at"])


def indexes() -> str:
    """Which indexes this database gets: "partial", "whole" or "none" (SQLite)."""
    dialect = dialect_for(op.get_context().dialect)
    if not dialect.supports_partial_indexes:
        return "whole"
    return "partial" if dialect.supports_skip_locked else "none"


def upgrade() -> None:
    kind = indexes()
    if kind == "whole":
        op.create_index(WHOLE[0], "outbox_message", WHOLE[1])
    elif kind == "partial":
        for name, (columns, where) in INDEXES.items():
            op.create_index(name, "outbox_message", columns, postgresql_where=sa.text(where))


def downgrade() -> None:
    kind = indexes()
    if kind == "whole":
        op.drop_index(WHOLE[0], table_name="outbox_message")
    elif kind == "partial":
        for name in INDEXES:
            op.drop_index(name, table_name="outbox_message")
