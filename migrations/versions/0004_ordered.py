"""Ordered delivery per key: ``seq`` on outbox_message, the ``outbox_sequence`` table,
and the ``skipped`` status.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24

``seq`` is NULL on every existing row (they were not sent with ``ordered=True``). The
status CHECK gains ``skipped`` (an operator gave a message up with ``outbox skip``); on
SQLite, which cannot alter a constraint, the table is copied (batch mode). On MySQL and
MariaDB ``topic`` and ``key`` become ``utf8mb4_bin`` (compared byte for byte, as brokers
do: the default collation made "Order" and "order" one key), which rebuilds the table.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

from outbox.dialects import dialect_for
from outbox.table import name_type

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

CHECK = "ck_outbox_message_status"
WITH_SKIPPED = "status IN ('pending', 'sent', 'dead', 'skipped')"
WITHOUT_SKIPPED = "status IN ('pending', 'sent', 'dead')"


BINARY = mysql.VARCHAR(255, charset="utf8mb4", collation="utf8mb4_bin")
DEFAULT = mysql.VARCHAR(255, charset="utf8mb4")


def upgrade() -> None:
    names_collated(BINARY)
    with op.batch_alter_table("outbox_message") as batch:
        batch.add_column(sa.Column("seq", sa.BigInteger()))
        batch.drop_constraint(CHECK, type_="check")
        batch.create_check_constraint(CHECK, sa.text(WITH_SKIPPED))
    # Status before seq: a look below a seq reads a key's pending and dead rows only, not
    # its retained sent ones. Only ordered rows, where a partial index exists.
    op.create_index(
        "ix_outbox_message_key_seq",
        "outbox_message",
        ["topic", "key", "status", "seq"],
        postgresql_where=sa.text("seq IS NOT NULL"),
        sqlite_where=sa.text("seq IS NOT NULL"),
    )
    op.create_table(
        "outbox_sequence",
        sa.Column("topic", name_type, nullable=False),
        sa.Column("key", name_type, nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("topic", "key", name="pk_outbox_sequence"),
    )


def downgrade() -> None:
    op.drop_table("outbox_sequence")
    op.drop_index("ix_outbox_message_key_seq", table_name="outbox_message")
    # A skipped row is not delivered: it goes back to dead, which the old CHECK allows.
    op.execute("UPDATE outbox_message SET status = 'dead' WHERE status = 'skipped'")
    with op.batch_alter_table("outbox_message") as batch:
        batch.drop_constraint(CHECK, type_="check")
        batch.create_check_constraint(CHECK, sa.text(WITHOUT_SKIPPED))
        batch.drop_column("seq")
    names_collated(DEFAULT)


def names_collated(varchar: mysql.VARCHAR) -> None:
    """MySQL and MariaDB: topic and key of outbox_message in ``varchar``'s collation."""
    if dialect_for(op.get_context().dialect).column_type("name") is None:  # the default's
        return
    with op.batch_alter_table("outbox_message") as batch:
        batch.alter_column("topic", type_=varchar, existing_nullable=False)
        batch.alter_column("key", type_=varchar, existing_nullable=True)
