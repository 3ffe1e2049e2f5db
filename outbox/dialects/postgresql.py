"""PostgreSQL: SKIP LOCKED, RETURNING, arrays as parameters, ``timestamptz``, an advisory
lock for migrations, and percentiles computed by the database."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from sqlalchemy import URL, Column, Connection, Index, Table, bindparam, func, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import TableValuedAlias
from sqlalchemy.types import TypeEngine

from outbox.dialects.base import Dialect

# Any number taken only by us; serialises concurrent `outbox migrate` runs on PostgreSQL.
MIGRATION_LOCK_KEY = 0x0B0C5_2024


class PostgreSQL(Dialect):
    """PostgreSQL (psycopg, asyncpg)."""

    name = "postgresql"
    schemes = ("postgres",)
    default_driver = "psycopg"
    async_driver = "psycopg"  # psycopg serves both
    sync_drivers: ClassVar[Mapping[str, str]] = {"asyncpg": "psycopg", "psycopg_async": "psycopg"}
    default_port = 5432

    supports_skip_locked = True
    supports_upsert_returning = True
    binds_arrays = True
    percentiles_in_sql = True
    stores_zone = True
    # Autocommit saves the BEGIN and COMMIT round trips of a one-statement transaction;
    # the drivers switch it without a round trip.
    free_autocommit = True
    schema_in_options = True
    supports_partial_indexes = True
    partitions_outbox = True
    brin_indexes = True
    # The backlog's correlated subquery makes the planner's estimate huge: compiling the
    # plan took a second where running it takes tens of milliseconds (bench/dashboard.py).
    reading_setup = ("SET LOCAL jit = off",)

    def now_sql(self) -> str:
        # timestamptz: an instant, whatever the session's TimeZone. CURRENT_TIMESTAMP is the
        # transaction's start: a long transaction would hand the sweeper a row that looks
        # old the moment it commits, racing the fast path.
        return "statement_timestamp()"

    def now_plus_sql(self, micros: str) -> str:
        # An interval of microseconds only (no days): the same length in every TimeZone.
        return f"(statement_timestamp() + {micros} * INTERVAL '1 microsecond')"

    def partial_index_kw(self, where: str) -> dict[str, Any]:
        return {"postgresql_where": text(where)}

    def only_index(
        self, name: str, column: str, using: str | None = None, where: str = ""
    ) -> Index:
        """An index made on PostgreSQL only (BRIN, or one the other databases need not)."""
        kw: dict[str, Any] = self.partial_index_kw(where) if where else {}
        if using is not None:
            kw["postgresql_using"] = using
        return Index(name, column, **kw).ddl_if(dialect=self.name)

    def timeouts(self, url: URL, connect_s: float, read_s: float | None) -> dict[str, Any]:
        if url.get_driver_name() == "asyncpg":  # seconds, a float; no statement timeout here
            args: dict[str, Any] = {"timeout": connect_s}
        else:  # libpq: whole seconds, at least 2
            args = {"connect_timeout": max(2, math.ceil(connect_s))}
        args = {k: v for k, v in args.items() if k not in url.query}
        if read_s is not None:  # a query, and so a read, ends then
            timeout = f"-c statement_timeout={int(read_s * 1000)}"
            args["options"] = f"{url.query.get('options', '')} {timeout}".strip()
        return args

    def insert_ignoring(self, table: Table, key: Column[Any]) -> Insert:
        return postgresql.insert(table).on_conflict_do_nothing(index_elements=[key])

    def upsert_adding(
        self, table: Table, keys: Sequence[Column[Any]], total: Column[Any]
    ) -> Insert:
        first = postgresql.insert(table)
        return first.on_conflict_do_update(
            index_elements=list(keys),
            set_={total.name: total + first.excluded[total.name]},
        ).returning(*keys, total)

    def rows_of_arrays(
        self, name: str, columns: Sequence[tuple[str, str, TypeEngine[Any]]]
    ) -> TableValuedAlias:
        arrays = (bindparam(param, type_=postgresql.ARRAY(type_)) for _, param, type_ in columns)
        return (
            func.unnest(*arrays)
            .table_valued(*(column for column, _, _ in columns))
            .render_derived(name=name)
        )

    def minute_of(self, column: ColumnElement[Any]) -> ColumnElement[Any]:
        return func.date_trunc("minute", column)

    def millis_between(
        self, start: ColumnElement[Any], end: ColumnElement[Any]
    ) -> ColumnElement[Any]:
        return func.extract("epoch", end - start) * 1000

    def percentile(self, fraction: float, value: ColumnElement[Any]) -> ColumnElement[Any]:
        return func.percentile_cont(fraction).within_group(value)

    def lock_migrations(self, conn: Connection, caller: bool, wait_s: float) -> bool:
        # Released by the migration's COMMIT (the caller's, with ``caller``).
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
        return True
