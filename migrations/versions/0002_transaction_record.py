"""Create outbox_transaction_record (model B's check-back ledger).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.table import session_now, time_type

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_transaction_record",
        sa.Column("transaction_id", sa.String(64), nullable=False),
        sa.Column("producer_group", sa.String(255), nullable=False),
        sa.Column("msg_id", sa.Uuid(), nullable=False),
        sa.Column("created_at", time_type, nullable=False, server_default=session_now()),
        sa.PrimaryKeyConstraint("transaction_id", name="pk_outbox_transaction_record"),
    )


def downgrade() -> None:
    op.drop_table("outbox_transaction_record")
