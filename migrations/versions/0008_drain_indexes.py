"""Indexes for the drain's claims: pending rows by id, unordered apart from ordered.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28

`outbox drain` takes the unordered rows past the highest id it claimed, in id order, and
the ordered heads whatever their id. One statement with both (an OR) could use no index
bound: each batch of 500 read every remaining pending row through ix_outbox_message_pending
and sorted them, so a drain was quadratic in its backlog (1M rows at 2.9k msg/s against
18k msg/s for 20k). Now two claims, each on its own range: partial indexes on (id) over
pending unscheduled rows, unordered and ordered apart, where they exist (PostgreSQL,
SQLite); on MySQL/MariaDB one index (status, deliver_at, seq, id), over every row, whose
leading columns pick the same rows. Building them on a big table blocks writes to it for
the time they take (seconds per million rows).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.dialects import dialect_for

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

CLAIMABLE = "status = 'pending' AND deliver_at IS NULL"
PARTIAL = {
    "ix_outbox_message_unordered": f"{CLAIMABLE} AND seq IS NULL",
    "ix_outbox_message_ordered": f"{CLAIMABLE} AND seq IS NOT NULL",
}
WHOLE = ("ix_outbox_message_claimable", ["status", "deliver_at", "seq", "id"])


def upgrade() -> None:
    if not dialect_for(op.get_context().dialect).supports_partial_indexes:
        op.create_index(WHOLE[0], "outbox_message", WHOLE[1])
        return
    for name, where in PARTIAL.items():
        op.create_index(
            name,
            "outbox_message",
            ["id"],
            postgresql_where=sa.text(where),
            sqlite_where=sa.text(where),
        )


def downgrade() -> None:
    if not dialect_for(op.get_context().dialect).supports_partial_indexes:
        op.drop_index(WHOLE[0], table_name="outbox_message")
        return
    for name in PARTIAL:
        op.drop_index(name, table_name="outbox_message")
