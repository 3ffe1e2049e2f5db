"""Scheduled messages: ``deliver_at`` on outbox_message, its index, and the ``canceled``
status.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24

``deliver_at`` is NULL on every existing row (published as soon as committed). A
scheduled row is published by a relay's scheduler once the database clock passes its
``deliver_at``, never by the fast path or the sweeper's age rule: the pending index the
sweeper scans leaves scheduled rows out (where partial indexes exist), so a large
schedule costs its sweeps nothing. ``ix_outbox_message_due`` finds the next due row.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.dialects import dialect_for
from outbox.table import time_type

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

CHECK = "ck_outbox_message_status"
WITH_CANCELED = "status IN ('pending', 'sent', 'dead', 'skipped', 'canceled')"
WITHOUT_CANCELED = "status IN ('pending', 'sent', 'dead', 'skipped')"
PENDING_NOW = "status = 'pending' AND deliver_at IS NULL"
PENDING = "status = 'pending'"
SCHEDULED = "status = 'pending' AND deliver_at IS NOT NULL"


def upgrade() -> None:
    with op.batch_alter_table("outbox_message") as batch:
        batch.add_column(sa.Column("deliver_at", time_type))
        batch.drop_constraint(CHECK, type_="check")
        batch.create_check_constraint(CHECK, sa.text(WITH_CANCELED))
    pending_index(PENDING_NOW)
    # Status first for MySQL/MariaDB (no partial index): a look reads pending rows only.
    op.create_index(
        "ix_outbox_message_due",
        "outbox_message",
        ["status", "deliver_at"],
        postgresql_where=sa.text(SCHEDULED),
        sqlite_where=sa.text(SCHEDULED),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_message_due", table_name="outbox_message")
    pending_index(PENDING)
    # A canceled row was never to be delivered: skipped, which the old CHECK allows, says so.
    op.execute("UPDATE outbox_message SET status = 'skipped' WHERE status = 'canceled'")
    with op.batch_alter_table("outbox_message") as batch:
        batch.drop_constraint(CHECK, type_="check")
        batch.create_check_constraint(CHECK, sa.text(WITHOUT_CANCELED))
        batch.drop_column("deliver_at")


def partial() -> bool:
    return dialect_for(op.get_context().dialect).supports_partial_indexes


def pending_index(where: str) -> None:
    """ix_outbox_message_pending (created_at) again, over the rows ``where`` picks."""
    if not partial():
        return  # a plain index on created_at there: nothing to narrow
    op.drop_index("ix_outbox_message_pending", table_name="outbox_message")
    op.create_index(
        "ix_outbox_message_pending",
        "outbox_message",
        ["created_at"],
        postgresql_where=sa.text(where),
        sqlite_where=sa.text(where),
    )
