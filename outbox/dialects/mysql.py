"""MySQL and MariaDB (one protocol, one dialect here): ``DATETIME(6)`` in UTC, binary
collation for names, ``ON DUPLICATE KEY`` upserts, named locks (``GET_LOCK``) for
migrations and dedup keys, and READ COMMITTED for the sweeps."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from sqlalchemy import URL, Column, Connection, Engine, Table, event, text
from sqlalchemy.dialects import mysql
from sqlalchemy.sql.dml import Insert
from sqlalchemy.types import TypeEngine

from outbox.dedup_locks import lock_dedup_keys
from outbox.dialects.base import Dialect
from outbox.message import Message

# The session-level named lock of `outbox migrate`, one per database (64 characters at most).
MIGRATION_LOCK = "LEFT(CONCAT('outbox_migrate.', DATABASE()), 64)"


class MySQL(Dialect):
    """MariaDB and MySQL (PyMySQL, asyncmy, aiomysql)."""

    name = "mysql"
    aliases = ("mariadb",)
    default_driver = "pymysql"
    async_driver = "asyncmy"
    sync_drivers: ClassVar[Mapping[str, str]] = {"asyncmy": "pymysql", "aiomysql": "pymysql"}
    default_port = 3306

    supports_skip_locked = True
    # MariaDB commits each DDL statement: only a session-level named lock spans them.
    transactional_ddl = False
    # InnoDB reads the subquery of a locking statement in a snapshot that may predate the
    # rows it locked: a claim's look at a key's predecessors is checked again.
    stale_locking_reads = True
    schema_is_database = True
    # Migrations 0001 and 0002 wrote the session's local time (migration 0003 fixed it).
    local_session_clock = True
    # Each statement of a sweep reads what committed before it, not the snapshot of the
    # transaction's first read (relay.store's still_heads needs it).
    fresh_reads_isolation = "READ COMMITTED"

    def now_sql(self) -> str:
        # CURRENT_TIMESTAMP into a DATETIME is the session's local time: a session in +01:00
        # would write rows that look an hour younger. Parentheses: MySQL 8 takes a function
        # other than CURRENT_TIMESTAMP as a column default only in them.
        return "(UTC_TIMESTAMP(6))"

    def now_plus_sql(self, micros: str) -> str:
        return f"(UTC_TIMESTAMP(6) + INTERVAL {micros} MICROSECOND)"

    def session_now_sql(self) -> str:
        return "CURRENT_TIMESTAMP(6)"

    def datetime_type(self) -> TypeEngine[Any]:
        # DATETIME drops fractions of a second unless asked.
        return mysql.DATETIME(fsp=6)

    def column_type(self, kind: str) -> TypeEngine[Any] | None:
        # A topic and a key compare byte for byte, as brokers do: the default collation
        # would make "Order" and "order" one key. BLOB stops at 64 KiB.
        if kind == "name":
            return mysql.VARCHAR(255, charset="utf8mb4", collation="utf8mb4_bin")
        if kind == "payload":
            return mysql.LONGBLOB()
        return None

    def timeouts(self, url: URL, connect_s: float, read_s: float | None) -> dict[str, Any]:
        driver = url.get_driver_name()
        if driver == "aiomysql":  # no read timeout: a silent host hangs it
            args: dict[str, Any] = {"connect_timeout": connect_s}
        else:  # PyMySQL and asyncmy read the server's greeting with read_timeout
            # (asyncmy's connect_timeout bounds the TCP connect alone)
            args = {"connect_timeout": connect_s, "read_timeout": connect_s}
            if read_s is not None and driver != "asyncmy":
                args["write_timeout"] = read_s
        return {k: v for k, v in args.items() if k not in url.query}

    def limit_reads(self, engine: Engine, url: URL, read_s: float | None) -> None:
        if url.get_driver_name() != "aiomysql":  # it has no read timeout to lift
            event.listen(engine, "connect", functools.partial(_reads_wait, read_s))

    def insert_ignoring(self, table: Table, key: Column[Any]) -> Insert:
        # No change: the existing row stays as it is.
        return mysql.insert(table).on_duplicate_key_update({key.name: key})

    def upsert_adding(
        self, table: Table, keys: Sequence[Column[Any]], total: Column[Any]
    ) -> Insert:
        added = mysql.insert(table)
        return added.on_duplicate_key_update({total.name: total + added.inserted[total.name]})

    def lock_dedup_keys(self, conn: Any, messages: Sequence[Message]) -> None:
        # Waiters of one key must not deadlock (outbox.dedup_locks).
        lock_dedup_keys(conn, messages)

    def lock_migrations(self, conn: Connection, caller: bool, wait_s: float) -> bool:
        got = conn.execute(text(f"SELECT GET_LOCK({MIGRATION_LOCK}, :s)"), {"s": wait_s})
        return bool(got.scalar() == 1)

    def unlock_migrations(self, conn: Connection) -> None:
        conn.execute(text(f"SELECT RELEASE_LOCK({MIGRATION_LOCK})"))


def _reads_wait(read_s: float | None, dbapi_connection: Any, _record: object) -> None:
    """After the handshake, reads wait ``read_s`` (None: as long as the queries take)."""
    # PyMySQL and asyncmy (behind SQLAlchemy's adapter) have no public setter for it.
    driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    driver._read_timeout = read_s
