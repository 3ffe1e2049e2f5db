"""The ``Dialect`` base: what every database-specific choice defaults to.

A subclass per backend (``outbox.dialects.postgresql``, ``.mysql``, ``.sqlite``) overrides
what its database does differently. The base is also what a database outbox-relay does
not support gets (SQLAlchemy's own default dialect among them, which ``str(statement)``
uses): standard SQL where there is one, ``NotImplementedError`` where there is none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar, TypeVar

from sqlalchemy import URL, Column, Connection, DateTime, Engine, Table
from sqlalchemy.pool import Pool, QueuePool
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import TableValuedAlias
from sqlalchemy.types import TypeEngine

from outbox.message import Message

T = TypeVar("T")


class Dialect:
    """Every choice that depends on the database, in one object per backend.

    Capabilities are class attributes (read them, never the database's name); SQL
    variants, locks, the clock and column types are methods. One instance per backend
    (``outbox.dialects.dialect_for``), shared by every thread: it holds no connection.
    """

    name = "default"  # SQLAlchemy's name of the dialect
    aliases: tuple[str, ...] = ()  # other SQLAlchemy names it serves (mariadb)
    schemes: tuple[str, ...] = ()  # URL schemes it serves beside its names (postgres)
    default_driver: str | None = None  # the driver outbox-relay installs for a bare scheme
    async_driver: str | None = None  # the asyncio driver for a sync URL
    sync_drivers: ClassVar[Mapping[str, str]] = {}  # an async driver -> its sync counterpart
    default_port: int | None = None

    # Capabilities.
    supports_skip_locked = False  # FOR UPDATE SKIP LOCKED shares rows among claimers
    supports_upsert_returning = False  # an upsert tells the row it left (RETURNING)
    binds_arrays = False  # a batch travels as arrays: one statement, compiled once
    percentiles_in_sql = False  # percentile_cont and per-minute buckets in the database
    transactional_ddl = True  # DDL waits for the COMMIT (MariaDB commits each statement)
    stores_zone = False  # a timestamp column keeps an instant (timestamptz)
    free_autocommit = False  # the driver switches autocommit without a round trip
    stale_locking_reads = False  # a locking read's subquery may see an older snapshot
    file_database = False  # the database is a file on this host
    schema_in_options = False  # the schema travels as libpq options (search_path)
    schema_is_database = False  # a schema is a database (MySQL)
    alters_by_batch = False  # Alembic recreates a table to alter it (SQLite)
    supports_partial_indexes = False  # an index over the rows a WHERE picks
    partitions_outbox = False  # outbox.partitions: outbox_message by day (`--partitioned`)
    brin_indexes = False  # block range indexes (the reconciliation's window reads)
    local_session_clock = False  # CURRENT_TIMESTAMP is the session's local time (DATETIME)
    own_poolclass: type[Pool] = QueuePool  # the relay's own engine's pool
    fresh_reads_isolation: str | None = None  # the sweeps' level, where the default is not
    reading_setup: tuple[str, ...] = ()  # statements that open a dashboard page's reads

    def __init__(self, name: str | None = None) -> None:
        if name is not None:
            self.name = name
        self._built: dict[Callable[..., Any], Any] = {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} dialect {self.name!r}>"

    @property
    def names(self) -> tuple[str, ...]:
        """Every SQLAlchemy dialect name this one serves."""
        return (self.name, *self.aliases)

    @property
    def target_backend(self) -> str:
        """The backend a Target names (one for servers that speak one protocol)."""
        return self.name

    def built(self, build: Callable[[Dialect], T]) -> T:
        """``build(self)``, built once per dialect: a statement made per call is compiled
        per call (about 200 us)."""
        found = self._built.get(build)
        if found is None:
            found = self._built[build] = build(self)
        return found

    # Time: one clock, the database's, in UTC (outbox.table.db_now).

    def now_sql(self) -> str:
        """The database's now, in UTC, as finely as it keeps it."""
        return "CURRENT_TIMESTAMP"

    def now_plus_sql(self, micros: str) -> str | None:
        """Now plus ``micros`` microseconds (a BIGINT expression); None: no such SQL."""
        return None

    def session_now_sql(self) -> str:
        """The default migrations 0001 and 0002 created (outbox.table.session_now)."""
        return self.now_sql()

    def datetime_type(self) -> TypeEngine[Any]:
        """The column type of a point in time."""
        return DateTime(timezone=True)

    def bind_time(self, value: datetime) -> datetime:
        """An aware UTC ``value`` as the driver must be given it: naive where the column
        keeps no zone (drivers drop an offset there rather than convert it)."""
        return value if self.stores_zone else value.replace(tzinfo=None)

    # Types and indexes.

    def column_type(self, kind: str) -> TypeEngine[Any] | None:
        """This database's type for a kind of column (``id``, ``name``, ``payload``);
        None: the portable one."""
        return None

    def partial_index_kw(self, where: str) -> dict[str, Any]:
        """An Index's keywords restricting it to the rows ``where`` picks; none where
        partial indexes do not exist (the index then covers every row)."""
        return {}

    # Connections.

    def timeouts(self, url: URL, connect_s: float, read_s: float | None) -> dict[str, Any]:
        """The driver's own connect (and read) timeout arguments; the URL's win."""
        return {}

    def limit_reads(self, engine: Engine, url: URL, read_s: float | None) -> None:
        """Set up ``engine`` so that reads wait at most ``read_s`` once connected."""

    def in_memory(self, url: URL) -> bool:
        """Is ``url`` a database in memory (each connection its own)?"""
        return False

    def driver_change_refused(self, url: URL) -> bool:
        """Would another driver for ``url`` reach another database?"""
        return False

    # SQL variants.

    def insert_ignoring(self, table: Table, key: Column[Any]) -> Insert:
        """An INSERT that writes nothing for a row whose ``key`` is in ``table``."""
        raise NotImplementedError(f"{self.name}: no INSERT ignoring a duplicate key")

    def upsert_adding(
        self, table: Table, keys: Sequence[Column[Any]], total: Column[Any]
    ) -> Insert:
        """An INSERT that adds the given ``total`` to an existing row's (``keys`` match);
        with ``supports_upsert_returning``, it returns the keys and the new total."""
        raise NotImplementedError(f"{self.name}: no upsert")

    def rows_of_arrays(
        self, name: str, columns: Sequence[tuple[str, str, TypeEngine[Any]]]
    ) -> TableValuedAlias:
        """A derived table ``name`` whose rows zip array parameters: each column is
        (column name, parameter name, element type). Only with ``binds_arrays``."""
        raise NotImplementedError(f"{self.name}: no array parameters")

    def minute_of(self, column: ColumnElement[Any]) -> ColumnElement[Any]:
        """The minute ``column`` falls in. Only with ``percentiles_in_sql``."""
        raise NotImplementedError(f"{self.name}: no per-minute buckets in SQL")

    def millis_between(
        self, start: ColumnElement[Any], end: ColumnElement[Any]
    ) -> ColumnElement[Any]:
        """``end - start`` in milliseconds. Only with ``percentiles_in_sql``."""
        raise NotImplementedError(f"{self.name}: no interval arithmetic in SQL")

    def percentile(self, fraction: float, value: ColumnElement[Any]) -> ColumnElement[Any]:
        """The continuous ``fraction`` percentile of ``value`` over a group."""
        raise NotImplementedError(f"{self.name}: no percentiles in SQL")

    # Locks.

    def lock_dedup_keys(self, conn: Any, messages: Sequence[Message]) -> None:
        """Serialise the transactions that insert one dedup msg_id, where waiting on
        the row alone could deadlock; nothing needs it but InnoDB."""

    def lock_migrations(self, conn: Connection, caller: bool, wait_s: float) -> bool:
        """Take the lock that serialises migrations; False when another held it past
        ``wait_s``. ``caller``: the transaction is the caller's (begin none here)."""
        return True

    def unlock_migrations(self, conn: Connection) -> None:
        """Release what ``lock_migrations`` took past its transaction (only where DDL
        commits, ``transactional_ddl`` False)."""
