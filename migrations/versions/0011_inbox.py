"""The consumer's inbox: outbox_inbox, one row per (consumer, msg_id) handled.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28

outbox.inbox.Inbox writes a row in the handler's own transaction, so a copy of a
message it handled is acknowledged without running the handler again; a message that
failed past its attempts stays as the consumer's dead letter, with its topic, headers
and payload to run it again. An ordered message's key and seq say which of its key's
messages came before it. A new, empty table: nothing to convert.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.table import db_now, name_type, payload_type, time_type

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

TABLE = "outbox_inbox"


def upgrade() -> None:
    op.create_table(
        TABLE,
        sa.Column("consumer", name_type, nullable=False),
        sa.Column("msg_id", sa.Uuid(), nullable=False),
        sa.Column("topic", name_type, nullable=False),
        sa.Column("key", name_type),
        sa.Column("seq", sa.BigInteger()),
        sa.Column("status", sa.String(8), nullable=False, server_default=sa.text("'handled'")),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("1")),
        sa.Column("last_error", sa.Text()),
        sa.Column("headers", sa.JSON()),
        sa.Column("payload", payload_type),
        sa.Column("created_at", time_type, nullable=False, server_default=db_now()),
        sa.PrimaryKeyConstraint("consumer", "msg_id", name="pk_outbox_inbox"),
        sa.CheckConstraint(
            "status IN ('handled', 'dead', 'requeued')", name="ck_outbox_inbox_status"
        ),
    )
    op.create_index("ix_outbox_inbox_status", TABLE, ["consumer", "status", "created_at"])
    op.create_index("ix_outbox_inbox_key_seq", TABLE, ["consumer", "topic", "key", "seq"])


def downgrade() -> None:
    op.drop_table(TABLE)
