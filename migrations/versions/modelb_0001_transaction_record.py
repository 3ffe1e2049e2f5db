"""Create outbox_transaction_record (model B's check-back ledger), on its own branch.

Revision ID: modelb_0001
Revises: (none: the base of the ``modelb`` branch; depends on 0002)
Create Date: 2026-12-01

Only model B (relay.lab.halfop's SqlTransactionListener, ``outbox compare``) uses this table,
so a plain ``outbox migrate`` does not create it: ``outbox migrate --model-b`` does, and
so does model B's first use. A database migrated before this branch existed has the
table already (revision 0002 made it, 0003 moved its clock to UTC): it is adopted as it
is, rows and all. It hangs off 0002, where the table was made until then: 0003 converts
(on MariaDB) the table it finds, whichever came first, and a downgrade to 0002 keeps it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from outbox.table import db_now, time_type

revision = "modelb_0001"
down_revision = None
branch_labels = ("modelb",)
depends_on = "0002"

TABLE = "outbox_transaction_record"


def upgrade() -> None:
    if not context.is_offline_mode() and sa.inspect(op.get_bind()).has_table(TABLE):
        return  # made by 0002 before the branch existed: adopted
    op.create_table(
        TABLE,
        sa.Column("transaction_id", sa.String(64), nullable=False),
        sa.Column("producer_group", sa.String(255), nullable=False),
        sa.Column("msg_id", sa.Uuid(), nullable=False),
        sa.Column("created_at", time_type, nullable=False, server_default=db_now()),
        sa.PrimaryKeyConstraint("transaction_id", name="pk_outbox_transaction_record"),
    )


def downgrade() -> None:
    op.drop_table(TABLE)
