"""Model B's check-back ledger: once created here, now on its own branch.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22

Until outbox-relay 0.x this revision created ``outbox_transaction_record`` (model B's
table) in every database. It now does nothing on the way up: the table belongs to the
``modelb`` branch (``modelb_0001``), applied by ``outbox migrate --model-b`` or when model
B is first used. A database migrated before keeps its table, with its rows; the branch
adopts it. The way down still drops a table an earlier run of this revision created.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TABLE = "outbox_transaction_record"


def upgrade() -> None:
    pass


def downgrade() -> None:
    # Model B's branch, if applied, went down first (it depends on 0002): this is a
    # table an old run of 0002 made.
    if context.is_offline_mode() or sa.inspect(op.get_bind()).has_table(TABLE):
        op.drop_table(TABLE)
