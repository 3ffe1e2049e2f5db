"""The ``outbox_message`` table: one row per message, defined here and only here.

Alembic migrations in ``migrations/`` (installed as ``outbox.migrations``) create it;
a test checks that the migrated schema and this definition agree.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    Uuid,
    text,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

PENDING = "pending"
SENT = "sent"
DEAD = "dead"
STATUSES = (PENDING, SENT, DEAD)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "pk": "pk_%(table_name)s",
    }
)


class db_now(FunctionElement[datetime]):  # lower case: reads like the SQL function it is
    """The database clock, with sub-second precision on every supported dialect."""

    inherit_cache = True
    type = DateTime(timezone=True)


@compiles(db_now)
def _db_now_default(element: db_now, compiler: SQLCompiler, **kw: object) -> str:
    return "CURRENT_TIMESTAMP"


@compiles(db_now, "postgresql")
def _db_now_postgresql(element: db_now, compiler: SQLCompiler, **kw: object) -> str:
    # CURRENT_TIMESTAMP is the transaction's start: a long transaction would hand the
    # sweeper a row that looks old the moment it commits, racing the fast path.
    return "statement_timestamp()"


@compiles(db_now, "sqlite")
def _db_now_sqlite(element: db_now, compiler: SQLCompiler, **kw: object) -> str:
    # SQLite's CURRENT_TIMESTAMP has whole seconds only; this is UTC with milliseconds.
    return "(strftime('%Y-%m-%d %H:%M:%f', 'now'))"


@compiles(db_now, "mysql")
@compiles(db_now, "mariadb")
def _db_now_mysql(element: db_now, compiler: SQLCompiler, **kw: object) -> str:
    return "CURRENT_TIMESTAMP(6)"


# SQLite only auto-increments an INTEGER PRIMARY KEY; MariaDB's BLOB stops at 64 KiB
# and its DATETIME drops fractions of a second unless asked.
id_type = BigInteger().with_variant(Integer(), "sqlite")
payload_type = LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
time_type = DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")

outbox_message = Table(
    "outbox_message",
    metadata,
    Column("id", id_type, Identity(), primary_key=True),
    Column("msg_id", Uuid(), nullable=False, unique=True),
    Column("topic", String(255), nullable=False),
    Column("tags", String(255)),
    Column("key", String(255)),
    Column("headers", JSON()),
    Column("payload", payload_type, nullable=False),
    Column("created_at", time_type, nullable=False, server_default=db_now()),
    Column("attempts", Integer(), nullable=False, server_default=text("0")),
    Column("next_attempt_at", time_type),
    Column("last_error", Text()),
    Column("status", String(8), nullable=False, server_default=text(f"'{PENDING}'")),
    Column("sent_at", time_type),
    Column("receipt", String(255)),
    CheckConstraint(f"status IN {STATUSES!r}", name="status"),
    Index(
        "ix_outbox_message_pending",
        "created_at",
        postgresql_where=text(f"status = '{PENDING}'"),
        sqlite_where=text(f"status = '{PENDING}'"),
    ),
)

# Model B (relay.halfop.producer.SqlTransactionListener): one row per local transaction that
# committed, written inside that transaction, so check-back can tell commit from not.
transaction_record = Table(
    "outbox_transaction_record",
    metadata,
    Column("transaction_id", String(64), primary_key=True),
    Column("producer_group", String(255), nullable=False),
    Column("msg_id", Uuid(), nullable=False),
    Column("created_at", time_type, nullable=False, server_default=db_now()),
)
