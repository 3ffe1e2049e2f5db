"""SQLite: a file (or memory) on this host, one writer at a time, times as text with
milliseconds, ``ON CONFLICT`` upserts with RETURNING, and batch ALTERs for Alembic."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from sqlalchemy import URL, Column, Connection, Integer, Table, text
from sqlalchemy.dialects import sqlite
from sqlalchemy.pool import NullPool, Pool
from sqlalchemy.sql.dml import Insert
from sqlalchemy.types import TypeEngine

from outbox.dialects.base import Dialect


class SQLite(Dialect):
    """SQLite (the standard library's sqlite3, aiosqlite)."""

    name = "sqlite"
    async_driver = "aiosqlite"
    sync_drivers: ClassVar[Mapping[str, str]] = {"aiosqlite": "pysqlite"}

    # FOR UPDATE is not SQLite's: one writer at a time serialises the claims instead.
    supports_upsert_returning = True
    file_database = True
    alters_by_batch = True
    supports_partial_indexes = True
    own_poolclass: type[Pool] = NullPool  # a connection per checkout: none crosses threads

    def now_sql(self) -> str:
        # SQLite's CURRENT_TIMESTAMP has whole seconds only; this is UTC with milliseconds.
        return "(strftime('%Y-%m-%d %H:%M:%f', 'now'))"

    def now_plus_sql(self, micros: str) -> str:
        # (us + 999) / 1000 is integer division: whole milliseconds, rounded up.
        shift = f"printf('%+.3f seconds', (({micros}) + 999) / 1000 / 1000.0)"
        return f"(strftime('%Y-%m-%d %H:%M:%f', 'now', {shift}))"

    def column_type(self, kind: str) -> TypeEngine[Any] | None:
        # SQLite only auto-increments an INTEGER PRIMARY KEY.
        return Integer() if kind == "id" else None

    def partial_index_kw(self, where: str) -> dict[str, Any]:
        return {"sqlite_where": text(where)}

    def timeouts(self, url: URL, connect_s: float, read_s: float | None) -> dict[str, Any]:
        # How long a write waits for another's lock.
        return {k: v for k, v in {"timeout": connect_s}.items() if k not in url.query}

    def in_memory(self, url: URL) -> bool:
        return url.database in (None, "") or ":memory:" in url.database or "mode=memory" in str(url)

    def driver_change_refused(self, url: URL) -> bool:
        # Each connection of each engine would open an empty database of its own.
        return url.database in (None, "", ":memory:") or "mode=memory" in str(url)

    def insert_ignoring(self, table: Table, key: Column[Any]) -> Insert:
        return sqlite.insert(table).on_conflict_do_nothing(index_elements=[key])

    def upsert_adding(
        self, table: Table, keys: Sequence[Column[Any]], total: Column[Any]
    ) -> Insert:
        first = sqlite.insert(table)
        return first.on_conflict_do_update(
            index_elements=list(keys),
            set_={total.name: total + first.excluded[total.name]},
        ).returning(*keys, total)

    def lock_migrations(self, conn: Connection, caller: bool, wait_s: float) -> bool:
        if not caller:  # the write lock, till COMMIT; others wait (the caller's is its own)
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        return True
