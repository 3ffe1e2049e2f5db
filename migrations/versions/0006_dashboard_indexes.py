"""Indexes for the dashboard's reads over a large retained ledger: dead rows by id, sent
rows by sent_at.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25

With millions of retained sent rows, the overview's per-topic backlog read every row to
find the dead ones, its sends of the last hour and their per-minute chart read every sent
row, and a page of dead letters (`outbox dead`, the dashboard's /dead) walked the primary
key back through the sent rows newer than the dead ones (bench/dashboard.py). Partial
indexes where they exist (PostgreSQL, SQLite): over dead rows only, and over sent rows
only; status first on MySQL/MariaDB, where they cover every row. Building them on a big
table blocks writes to it for the time they take (seconds per million rows).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

INDEXES = {
    "ix_outbox_message_dead": (["status", "id"], "status = 'dead'"),
    "ix_outbox_message_sent": (["status", "sent_at"], "status = 'sent'"),
}


def upgrade() -> None:
    for name, (columns, where) in INDEXES.items():
        op.create_index(
            name,
            "outbox_message",
            columns,
            postgresql_where=sa.text(where),
            sqlite_where=sa.text(where),
        )


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(name, table_name="outbox_message")
