"""Indexes for `outbox status` and the dashboard's overview over a large retained ledger:
sent rows by sent_at alone, skipped and canceled rows by topic.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28

The sends of the last hour (status's sent_1m and sent_1h, the overview's sends per topic
and per minute) had ix_outbox_message_sent, on (status, sent_at) over sent rows only; but
PostgreSQL drops a condition the partial index's predicate implies (status = 'sent') from
the index's conditions, so its leading column was unbounded: the planner read the whole
index or, cheaper, the whole table (a sequential scan of 200,000 sent rows to count 3,600).
The skipped and canceled counts had no index at all. Partial indexes where they exist
(PostgreSQL, SQLite): on (sent_at) over sent rows, on (topic) over skipped and canceled
rows; MySQL/MariaDB need neither (ix_outbox_message_sent and ix_outbox_message_dead
cover every row there, status first). Building them on a big table blocks writes to it
for the time they take (seconds per million rows).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.dialects import dialect_for

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

INDEXES = {
    "ix_outbox_message_sent_at": (["sent_at"], "status = 'sent'"),
    "ix_outbox_message_settled": (["topic"], "status IN ('skipped', 'canceled')"),
}


def upgrade() -> None:
    if not dialect_for(op.get_context().dialect).supports_partial_indexes:
        return
    for name, (columns, where) in INDEXES.items():
        op.create_index(
            name,
            "outbox_message",
            columns,
            postgresql_where=sa.text(where),
            sqlite_where=sa.text(where),
        )


def downgrade() -> None:
    if not dialect_for(op.get_context().dialect).supports_partial_indexes:
        return
    for name in INDEXES:
        op.drop_index(name, table_name="outbox_message")
