"""Indexes for the nightly reconciliation's window read over JDBC (PostgreSQL only).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25

`outbox reconcile --ledger postgresql://...` reads the rows created in its span, or due
in it (scheduled earlier), and first their id bounds and count. Without an index on
created_at PostgreSQL scans the whole retained ledger three times a night. A BRIN index
(a few pages per million rows: created_at rises with the insert order) finds the span's
blocks; a partial index on deliver_at (over scheduled rows only, whatever their status:
ix_outbox_message_due holds the pending ones only) finds the scheduled ones. Other
databases get neither: their ledger is read from a Parquet export, and MySQL/MariaDB
already have a plain index on created_at (ix_outbox_message_pending covers every row
there).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.dialects import dialect_for

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if not dialect_for(op.get_context().dialect).brin_indexes:
        return
    op.create_index(
        "ix_outbox_message_created_brin", "outbox_message", ["created_at"], postgresql_using="brin"
    )
    op.create_index(
        "ix_outbox_message_scheduled",
        "outbox_message",
        ["deliver_at"],
        postgresql_where=sa.text("deliver_at IS NOT NULL"),
    )


def downgrade() -> None:
    if not dialect_for(op.get_context().dialect).brin_indexes:
        return
    op.drop_index("ix_outbox_message_scheduled", table_name="outbox_message")
    op.drop_index("ix_outbox_message_created_brin", table_name="outbox_message")
