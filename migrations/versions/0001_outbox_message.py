"""Create outbox_message.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.table import id_type, payload_type, session_now, time_type

revision = "0001"
down_revision = None
# The main line: `outbox@head` is its head (model B's table has its own branch, "modelb").
branch_labels = ("outbox",)
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_message",
        sa.Column("id", id_type, sa.Identity(), nullable=False),
        sa.Column("msg_id", sa.Uuid(), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("tags", sa.String(255)),
        sa.Column("key", sa.String(255)),
        sa.Column("headers", sa.JSON()),
        sa.Column("payload", payload_type, nullable=False),
        sa.Column("created_at", time_type, nullable=False, server_default=session_now()),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("next_attempt_at", time_type),
        sa.Column("last_error", sa.Text()),
        sa.Column("status", sa.String(8), nullable=False, server_default=sa.text("'pending'")),
        sa.Column("sent_at", time_type),
        sa.Column("receipt", sa.String(255)),
        sa.CheckConstraint(
            "status IN ('pending', 'sent', 'dead')", name="ck_outbox_message_status"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_message"),
        sa.UniqueConstraint("msg_id", name="uq_outbox_message_msg_id"),
    )
    op.create_index(
        "ix_outbox_message_pending",
        "outbox_message",
        ["created_at"],
        postgresql_where=sa.text("status = 'pending'"),
        sqlite_where=sa.text("status = 'pending'"),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_message_pending", table_name="outbox_message")
    op.drop_table("outbox_message")
