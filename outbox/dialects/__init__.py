"""The dialect seam: one ``Dialect`` per database owns every choice that depends on it.

SQL variants (upserts, array parameters, per-minute percentiles), locks (SKIP LOCKED,
the migration lock, MariaDB's dedup locks), the clock (``db_now``'s SQL), column types,
connection timeouts and capabilities live in ``outbox.dialects.postgresql``, ``.mysql``
and ``.sqlite``; no other module asks which database it is on. ``dialect_for`` gives
the one shared instance for an Engine, Connection, Session, URL, SQLAlchemy dialect or
name. It sits in the ``outbox`` layer: ``outbox`` writes rows through it and ``relay``
reads them through it.
"""

from __future__ import annotations

import functools
from typing import Any

from sqlalchemy import URL
from sqlalchemy.engine import Dialect as SqlaDialect
from sqlalchemy.orm import Session
from sqlalchemy.types import TypeEngine

from outbox.dialects.base import Dialect
from outbox.dialects.mysql import MySQL
from outbox.dialects.postgresql import PostgreSQL
from outbox.dialects.sqlite import SQLite

POSTGRESQL = PostgreSQL()
MYSQL = MySQL()
SQLITE = SQLite()
DIALECTS: tuple[Dialect, ...] = (POSTGRESQL, MYSQL, SQLITE)
_BY_NAME = {name: d for d in DIALECTS for name in d.names}


def dialect_for(bind: Any) -> Dialect:
    """The Dialect of ``bind``: an Engine, Connection (sync or async), Session, URL,
    SQLAlchemy dialect, or a dialect's name. A database outbox-relay does not support
    gets a base ``Dialect`` of its name (standard SQL, no capabilities)."""
    name = bind if isinstance(bind, str) else _name_of(bind)
    found = _BY_NAME.get(name)
    return found if found is not None else _other(name)


def _name_of(bind: Any) -> str:
    if isinstance(bind, SqlaDialect):
        return str(bind.name)
    if isinstance(bind, URL):
        return bind.get_backend_name()
    if isinstance(bind, Session):
        return str(bind.get_bind().dialect.name)
    return str(bind.dialect.name)  # Engine, Connection, AsyncEngine, AsyncConnection


@functools.cache
def _other(name: str) -> Dialect:
    return Dialect(name)


def with_variants(portable: TypeEngine[Any], kind: str) -> TypeEngine[Any]:
    """``portable`` with each database's own type for columns of ``kind`` (``id``,
    ``name``, ``payload``: ``Dialect.column_type``)."""
    for dialect in DIALECTS:
        own = dialect.column_type(kind)
        if own is not None:
            portable = portable.with_variant(own, *dialect.names)
    return portable


def partial_index_kw(where: str) -> dict[str, Any]:
    """An Index's keywords restricting it to the rows ``where`` picks on every database
    that has partial indexes."""
    kw: dict[str, Any] = {}
    for dialect in DIALECTS:
        kw.update(dialect.partial_index_kw(where))
    return kw


def driver_of_scheme() -> dict[str, str]:
    """A bare URL scheme -> the dialect+driver outbox-relay installs for it."""
    found: dict[str, str] = {}
    for dialect in DIALECTS:
        if dialect.default_driver is None:
            continue
        for scheme in (*dialect.schemes, *dialect.names):
            name = scheme if scheme in dialect.names else dialect.name
            found[scheme] = f"{name}+{dialect.default_driver}"
    return found


def async_drivers() -> dict[str, str]:
    """Every dialect's name -> the asyncio driver for it."""
    return {n: d.async_driver for d in DIALECTS if d.async_driver for n in d.names}


def sync_drivers() -> dict[str, str]:
    """Every async driver -> the sync driver of the same database."""
    return {a: s for dialect in DIALECTS for a, s in dialect.sync_drivers.items()}


__all__ = [
    "DIALECTS",
    "MYSQL",
    "POSTGRESQL",
    "SQLITE",
    "Dialect",
    "MySQL",
    "PostgreSQL",
    "SQLite",
    "async_drivers",
    "dialect_for",
    "driver_of_scheme",
    "partial_index_kw",
    "sync_drivers",
    "with_variants",
]
