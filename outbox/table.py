"""The ``outbox_message`` table: one row per message, defined here and only here.

Alembic migrations in ``migrations/`` (installed as ``outbox.migrations``) create it;
a test checks that the migrated schema and this definition agree.

One clock: every time in these tables is UTC, written by the database (``db_now``), on
every backend and whatever the time zone of the session that writes or reads it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

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
    TypeDecorator,
    Uuid,
    text,
)
from sqlalchemy.engine import Dialect as SqlaDialect
from sqlalchemy.exc import UnsupportedCompilationError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from outbox.dialects import (
    DIALECTS,
    POSTGRESQL,
    Dialect,
    dialect_for,
    partial_index_kw,
    with_variants,
)

PENDING = "pending"
SENT = "sent"
DEAD = "dead"
SKIPPED = "skipped"  # given up by an operator (`outbox skip`): not delivered, not expected
CANCELED = "canceled"  # a scheduled message canceled by the app (`Outbox.cancel`)
STATUSES = (PENDING, SENT, DEAD, SKIPPED, CANCELED)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "pk": "pk_%(table_name)s",
    }
)


class UtcDateTime(TypeDecorator[datetime]):
    """A point in time, stored in UTC: ``timestamptz`` on PostgreSQL, ``DATETIME(6)`` on
    MariaDB, text on SQLite (``Dialect.datetime_type``).

    MariaDB's DATETIME and SQLite's text hold no zone, and their drivers drop an aware
    datetime's offset (PyMySQL sends 10:00+02:00 as 10:00): a bound value is converted
    to UTC first, and a naive one is taken as UTC. Values read back are aware, in UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: SqlaDialect) -> Any:
        return dialect.type_descriptor(dialect_for(dialect).datetime_type())

    def process_bind_param(self, value: datetime | None, dialect: SqlaDialect) -> datetime | None:
        if value is None:
            return None
        # Naive is UTC here; PostgreSQL would read a naive timestamp in the session's zone.
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        return dialect_for(dialect).bind_time(value)

    def process_result_value(self, value: datetime | None, dialect: SqlaDialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class db_now(FunctionElement[datetime]):  # lower case: reads like the SQL function it is
    """The database clock in UTC, with sub-second precision on every supported dialect
    (``Dialect.now_sql``).

    The one "now" of the project: column defaults, ``sent_at`` and every age the relay
    compares (sweeper age, backoff, retention, ``outbox status``). It never depends on the
    session's time zone, so apps and relays in different zones agree.
    """

    inherit_cache = True
    type = UtcDateTime()


@compiles(db_now)
def _db_now(element: db_now, compiler: SQLCompiler, **kw: object) -> str:
    return dialect_for(compiler.dialect).now_sql()


class db_now_plus(FunctionElement[datetime]):
    """``db_now()`` plus a whole number of microseconds (its one argument, a BIGINT): a
    scheduled message's due time, ``send(delay=...)`` after its INSERT by the database
    clock. Exact to the microsecond but on SQLite, where ``db_now()`` has milliseconds:
    the delay is rounded up to one there, so a due time is never early."""

    inherit_cache = True
    type = UtcDateTime()


@compiles(db_now_plus)
def _db_now_plus(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    micros = compiler.process(element.clauses, **kw)
    sql = dialect_for(compiler.dialect).now_plus_sql(micros)
    if sql is None:  # no such SQL on this database
        raise UnsupportedCompilationError(compiler, type(element))
    return sql


class session_now(db_now):
    """The default migrations 0001 and 0002 created, kept so that they replay as they ran:
    on MariaDB the writing session's local time. Migration 0003 moves MariaDB to UTC."""

    inherit_cache = True


@compiles(session_now)
def _session_now(element: session_now, compiler: SQLCompiler, **kw: object) -> str:
    return dialect_for(compiler.dialect).session_now_sql()


# Each database's own types where the portable one falls short (Dialect.column_type):
# SQLite only auto-increments an INTEGER PRIMARY KEY; a topic and a key compare byte for
# byte on MariaDB too; its BLOB stops at 64 KiB.
id_type = with_variants(BigInteger(), "id")
name_type = with_variants(String(255), "name")
payload_type = with_variants(LargeBinary(), "payload")
time_type = UtcDateTime()


def partial_index(name: str, columns: list[str], where: str) -> Index:
    """An index over the rows ``where`` picks on PostgreSQL and SQLite; over every row on
    MySQL/MariaDB, which have no partial index."""
    return Index(name, *columns, **partial_index_kw(where))


def with_partial_indexes(present: bool = True) -> Any:
    """The dialect names (a tuple: ddl_if takes one, whatever its annotation says) of the
    databases that have partial indexes, or with ``present=False`` of those that don't."""
    return tuple(n for d in DIALECTS if d.supports_partial_indexes == present for n in d.names)


def partial_only(name: str, column: str, where: str) -> Index:
    """An index over the rows ``where`` picks, made only where partial indexes exist."""
    return Index(name, column, **partial_index_kw(where)).ddl_if(dialect=with_partial_indexes())


def drain_indexes() -> list[Index]:
    """The drain's claims by id (relay.store claim_due_stmt and claim_heads_stmt): pending,
    unscheduled rows past an id, unordered ones apart from ordered ones, so each batch
    reads about what it returns. Partial indexes on (id) where they exist; on
    MySQL/MariaDB one index whose leading columns pick the same rows."""
    claimable = f"status = '{PENDING}' AND deliver_at IS NULL"
    return [
        partial_only("ix_outbox_message_unordered", "id", f"{claimable} AND seq IS NULL"),
        partial_only("ix_outbox_message_ordered", "id", f"{claimable} AND seq IS NOT NULL"),
        Index("ix_outbox_message_claimable", "status", "deliver_at", "seq", "id").ddl_if(
            dialect=with_partial_indexes(present=False)
        ),
    ]


def settled_indexes() -> list[Index]:
    """What `outbox status` and the overview count of settled rows (relay.store.monitor):
    sent rows by sent_at alone (PostgreSQL leaves ix_outbox_message_sent's leading status
    unbounded, its predicate implying it), skipped and canceled rows by topic. Partial
    where partial indexes exist; MySQL/MariaDB's status-first indexes cover every row."""
    return [
        partial_only("ix_outbox_message_sent_at", "sent_at", f"status = '{SENT}'"),
        partial_only(
            "ix_outbox_message_settled", "topic", f"status IN ('{SKIPPED}', '{CANCELED}')"
        ),
    ]


def scans_keys(dialect: Dialect) -> bool:
    """Whether the claims find ordered heads key by key (relay.store.heads): a loose scan
    of a partial index, for claimers that share rows by SKIP LOCKED (PostgreSQL)."""
    return dialect.supports_partial_indexes and dialect.supports_skip_locked


def claim_indexes() -> list[Index]:
    """The sweeper's claims and every claim's ordered heads key by key, where the claims
    scan keys (scans_keys): pending unordered rows never tried by created_at (no blocked
    ordered row, no row backing off in the way), the tried ones by next_attempt_at (the
    due ones a range), and pending or dead ordered rows by (topic, key, seq), a key's
    first entry its head or the dead row that blocks it; the scheduler's rows by
    deliver_at alone (with statistics that predate their sends, PostgreSQL took
    ix_outbox_message_scheduled, sent rows and all, over ix_outbox_message_due). On
    MySQL/MariaDB the sweeper's rows by age behind leading columns that pick them
    (ix_outbox_message_pending is over every row there: the retained ledger and the
    scheduled rows came first)."""
    names: Any = tuple(n for d in DIALECTS if scans_keys(d) for n in d.names)  # see above
    unordered = f"status = '{PENDING}' AND deliver_at IS NULL AND seq IS NULL"
    aged = f"{unordered} AND next_attempt_at IS NULL"
    retried = f"{unordered} AND next_attempt_at IS NOT NULL"
    unsettled = f"status IN ('{PENDING}', '{DEAD}') AND seq IS NOT NULL"
    due = f"status = '{PENDING}' AND deliver_at IS NOT NULL"
    indexes = [
        Index("ix_outbox_message_unordered_age", "created_at", **partial_index_kw(aged)),
        Index("ix_outbox_message_retry", "next_attempt_at", **partial_index_kw(retried)),
        Index("ix_outbox_message_due_at", "deliver_at", **partial_index_kw(due)),
        Index("ix_outbox_message_heads", "topic", "key", "seq", **partial_index_kw(unsettled)),
    ]
    aged_whole = Index("ix_outbox_message_pending_age", "status", "deliver_at", "created_at")
    whole = aged_whole.ddl_if(dialect=with_partial_indexes(present=False))
    return [*(index.ddl_if(dialect=names) for index in indexes), whole]


outbox_message = Table(
    "outbox_message",
    metadata,
    Column("id", id_type, Identity(), primary_key=True),
    Column("msg_id", Uuid(), nullable=False, unique=True),
    Column("topic", name_type, nullable=False),
    Column("tags", String(255)),
    Column("key", name_type),
    Column("headers", JSON()),
    Column("payload", payload_type, nullable=False),
    Column("created_at", time_type, nullable=False, server_default=db_now()),
    Column("attempts", Integer(), nullable=False, server_default=text("0")),
    Column("next_attempt_at", time_type),
    Column("last_error", Text()),
    Column("status", String(8), nullable=False, server_default=text(f"'{PENDING}'")),
    Column("sent_at", time_type),
    Column("receipt", String(255)),
    # An ordered message's place among its (topic, key)'s: 1, 2, 3... (outbox_sequence).
    Column("seq", BigInteger()),
    # A scheduled message's due time (send(delay=...) or deliver_at=...), by the database
    # clock; NULL: published as soon as committed.
    Column("deliver_at", time_type),
    CheckConstraint(f"status IN {STATUSES!r}", name="status"),
    # What the sweeper scans by age: scheduled rows are the scheduler's (ix_..._due).
    partial_index(
        "ix_outbox_message_pending", ["created_at"], f"status = '{PENDING}' AND deliver_at IS NULL"
    ),
    # The next due scheduled row. Status first for MySQL/MariaDB (no partial index there).
    partial_index(
        "ix_outbox_message_due",
        ["status", "deliver_at"],
        f"status = '{PENDING}' AND deliver_at IS NOT NULL",
    ),
    # A key's pending or dead rows by seq (its head, the rows behind it): with status
    # before seq, a look below a seq never reads the key's retained sent rows.
    partial_index(
        "ix_outbox_message_key_seq", ["topic", "key", "status", "seq"], "seq IS NOT NULL"
    ),
    # Dead rows newest first (`outbox dead`, the dashboard) and counted per topic, sent rows
    # of the last hour (the dashboard's overview): never a walk through the retained ledger.
    # Status first for MySQL/MariaDB (no partial index there).
    partial_index("ix_outbox_message_dead", ["status", "id"], f"status = '{DEAD}'"),
    partial_index("ix_outbox_message_sent", ["status", "sent_at"], f"status = '{SENT}'"),
    # The reconciliation's window read over JDBC (spark_jobs.ledger): the rows created in
    # its span (BRIN: created_at rises with the inserts) or due in it. PostgreSQL only.
    POSTGRESQL.only_index("ix_outbox_message_created_brin", "created_at", using="brin"),
    POSTGRESQL.only_index(
        "ix_outbox_message_scheduled", "deliver_at", where="deliver_at IS NOT NULL"
    ),
    *drain_indexes(),
    *settled_indexes(),
    *claim_indexes(),
)

# The last sequence number taken per (topic, key) of ordered messages. Only senders write
# it, under its row lock, in their own transaction: concurrent writers of one key wait
# for each other, so seq order is commit order and a rollback gives its number back.
# The relay never locks it (it would stall the apps' transactions).
outbox_sequence = Table(
    "outbox_sequence",
    metadata,
    Column("topic", name_type, primary_key=True),
    Column("key", name_type, primary_key=True),
    Column("last_seq", BigInteger(), nullable=False),
)

# Model B (relay.lab.halfop.producer.SqlTransactionListener): one row per local transaction that
# committed, written inside that transaction, so check-back can tell commit from not.
transaction_record = Table(
    "outbox_transaction_record",
    metadata,
    Column("transaction_id", String(64), primary_key=True),
    Column("producer_group", String(255), nullable=False),
    Column("msg_id", Uuid(), nullable=False),
    Column("created_at", time_type, nullable=False, server_default=db_now()),
)

# The consumer's inbox (outbox.inbox.Inbox): one row per (consumer, msg_id) it handled,
# written in the handler's own transaction, so a copy of that message (the broker's
# redelivery, a requeue) is acknowledged without running the handler again. A message
# that failed past its attempts is kept as the consumer's dead letter, with what is
# needed to run it again (topic, headers, payload).
HANDLED = "handled"
REQUEUED = "requeued"  # a dead letter given back: the consumer runs it again
INBOX_STATUSES = (HANDLED, DEAD, REQUEUED)
inbox_message = Table(
    "outbox_inbox",
    metadata,
    Column("consumer", name_type, primary_key=True),
    Column("msg_id", Uuid(), primary_key=True),
    Column("topic", name_type, nullable=False),
    # An ordered message's key and place in it (Outbox-Seq): the last one handled of a key.
    Column("key", name_type),
    Column("seq", BigInteger()),
    Column("status", String(8), nullable=False, server_default=text(f"'{HANDLED}'")),
    Column("attempts", Integer(), nullable=False, server_default=text("1")),
    Column("last_error", Text()),
    Column("headers", JSON()),
    Column("payload", payload_type),
    Column("created_at", time_type, nullable=False, server_default=db_now()),
    CheckConstraint(f"status IN {INBOX_STATUSES!r}", name="status"),
    # A consumer's dead letters and requeued ones (`outbox dead --consumer`), and the
    # retention's old handled rows, by status and age.
    Index("ix_outbox_inbox_status", "consumer", "status", "created_at"),
    Index("ix_outbox_inbox_key_seq", "consumer", "topic", "key", "seq"),
)
