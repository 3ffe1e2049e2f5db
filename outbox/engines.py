"""Engines and drivers: an Engine or AsyncEngine for a database URL, with the driver's
timeouts; the sync and async driver of one database; the relay's engine beside the app's
(``relay_engine``); whether a connection autocommits; database and broker URL checks."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sqlalchemy import URL, Connection, Engine, create_engine
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.pool import AssertionPool, SingletonThreadPool, StaticPool

from outbox import aio
from outbox.broker import BROKER_SCHEMES
from outbox.dialects import async_drivers, dialect_for, sync_drivers
from outbox.errors import ConfigError
from outbox.names import check_name
from outbox.secrets import mask_url
from outbox.settings import CONNECT_TIMEOUT_S
from outbox.target import (
    connect_params,
    libpq_escape,
    libpq_words,
    mismatch,
    search_path_setting,
)
from outbox.urls import with_driver

if TYPE_CHECKING:  # imported by aio.require() when an async engine is made
    from sqlalchemy.ext.asyncio import AsyncEngine


def engine_from(
    db: str | URL | Engine,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    read_timeout_s: float | None = None,
    **kw: Any,
) -> Engine:
    """An Engine for a database URL, or the app's own Engine as it is.

    Connecting gives up after ``connect_timeout_s`` (a host that accepts TCP and never
    answers would hang a connect forever); ``read_timeout_s`` bounds every read too,
    for commands that must not wait forever. Parameters in the URL win.
    """
    if isinstance(db, Engine):
        return db
    if not isinstance(db, str | URL) or not db:
        raise ConfigError("db: must be a SQLAlchemy URL string or an Engine")
    try:
        url = sync_url(with_driver(db))
        args = timeouts(url, connect_timeout_s, read_timeout_s)
        engine = create_engine(url, connect_args=args, **kw)
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise unusable_url(db, exc) from None
    except ImportError as exc:  # the dialect's driver: PyMySQL is the `mysql` extra's
        hint = " (pip install 'outbox-relay[mysql]')" if exc.name == "pymysql" else ""
        raise ConfigError(
            f"db: {mask_url(db)!r} needs the driver {exc.name!r}, not installed{hint}"
        ) from None
    dialect_for(url).limit_reads(engine, url, read_timeout_s)
    return engine


def check_db_url(db: str) -> str:
    """``db`` if SQLAlchemy knows its dialect (no connection, no driver import yet)."""
    try:
        with_driver(db).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise unusable_url(db, exc) from None
    return db


def unusable_url(db: object, exc: Exception) -> ConfigError:
    hint = ""
    if isinstance(exc, NoSuchModuleError):  # a scheme SQLAlchemy has no dialect for
        hint = (
            "; use sqlite:///FILE, postgresql://... (postgres://, psycopg) or mysql://... "
            "(mariadb://, PyMySQL), or name a driver: postgresql+asyncpg://..."
        )
    return ConfigError(f"db: cannot use {mask_url(db)!r}: {exc}{hint}")


# The sync driver the relay's threads use for a database an app reaches through an async
# one (each Dialect's sync_drivers).
SYNC_DRIVERS = sync_drivers()
# And the async driver an async handler's sessions use for a database given by a sync URL
# (each Dialect's async_driver).
ASYNC_DRIVERS = async_drivers()


def is_async_url(db: str | URL) -> bool:
    """Does ``db`` name an asyncio driver (asyncpg, aiosqlite, asyncmy, aiomysql)?"""
    try:
        return bool(with_driver(db).get_dialect().is_async)
    except (ArgumentError, NoSuchModuleError, ValueError, ImportError):
        return False


def sync_url(url: URL) -> URL:
    """The same database through a sync driver (an async driver's sync counterpart)."""
    driver = SYNC_DRIVERS.get(url.get_driver_name())
    return url if driver is None else through(url, driver)


def async_url(url: URL) -> URL:
    """The same database through an asyncio driver (psycopg serves both)."""
    if is_async_url(url):
        return url
    driver = ASYNC_DRIVERS.get(url.get_backend_name())
    if driver is None:
        raise ConfigError(f"db: no asyncio driver known for {mask_url(url)!r}")
    return through(url, driver)


def through(url: URL, driver: str) -> URL:
    """``url`` with another driver, refused where that would reach another database."""
    backend = url.get_backend_name()
    if dialect_for(url).driver_change_refused(url):
        raise ConfigError(
            "db: an in-memory SQLite database cannot be shared by a sync and an async "
            "driver (the relay's and the app's); use a database file"
        )
    return url.set(drivername=f"{backend}+{driver}")


# Pools that hand the same DBAPI connection to every checkout (StaticPool, AssertionPool)
# or one per thread (SingletonThreadPool, whose cleanup closes other threads' connections).
SHARING_POOLS = (StaticPool, SingletonThreadPool, AssertionPool)
NO_RELAY_HINT = (
    "use a database file (sqlite:///app.db), or test without a relay: ob.recording(), "
    "broker='' or OUTBOX_START_RELAY=false"
)


def relay_engine(engine: Engine) -> Engine:
    """The engine the relay's threads use with the app's ``engine``: never one connection
    of the app's. A relay's COMMIT on a connection the app is using would commit the app's
    open transaction under it, and a message whose request then rolls back would be
    published.

    ``engine`` itself when its pool hands out connections of their own (QueuePool,
    NullPool...): one pool for the app and the relay. A new engine of the relay's own to
    the same database when its pool shares its connection (SHARING_POOLS); the caller
    disposes of it. A ConfigError when no other connection reaches the database: an
    in-memory SQLite database (another connection opens another, empty, one).
    """
    pool = engine.pool
    sharing = isinstance(pool, SHARING_POOLS)
    if sqlite_memory(engine.url) and (sharing or "cache=shared" not in str(engine.url)):
        kind = type(pool).__name__
        if sharing:
            raise ConfigError(
                f"db: the relay cannot share the app's single connection ({kind} on in-memory "
                "SQLite): its COMMITs would commit the app's open transactions, and another "
                f"connection opens another, empty, database; {NO_RELAY_HINT}"
            )
        raise ConfigError(
            f"db: the relay cannot reach an in-memory SQLite database ({kind}: each connection "
            f"opens another, empty, database); {NO_RELAY_HINT}"
        )
    return own_engine(engine) if sharing else engine


def own_engine(engine: Engine) -> Engine:
    """A new engine to ``engine``'s database whose pool gives each checkout a connection
    of its own: the same driver arguments (the pool's creator), connect listeners (a
    search_path, PRAGMAs) and execution options (a schema_translate_map). SQLite's pool
    opens a connection per checkout: one never crosses threads."""
    pool = engine.pool
    poolclass = dialect_for(engine).own_poolclass
    # Private, as Pool.recreate() uses them: SQLAlchemy offers no public copy of a pool's
    # creator and listeners into another pool class.
    own = create_engine(engine.url, creator=pool._creator, poolclass=poolclass)
    own.pool.dispatch._update(pool.dispatch, only_propagate=False)
    options = engine.get_execution_options()
    if options:
        own = own.execution_options(**options)
    if differs := mismatch(own, engine):
        own.dispose()
        raise ConfigError(f"db: the relay's own engine would reach another table ({differs})")
    return own


def sqlite_memory(url: URL) -> bool:
    """Is ``url`` an in-memory SQLite database?"""
    return dialect_for(url).in_memory(url)


AUTOCOMMIT = "AUTOCOMMIT"


def autocommits(conn: Connection) -> bool:
    """Does ``conn`` commit each statement at once (nothing it writes can roll back)?

    SQLAlchemy's ``AUTOCOMMIT`` isolation level, set on the engine (``create_engine(...,
    isolation_level="AUTOCOMMIT")``, ``engine.execution_options(...)``) or the connection
    (``conn.execution_options(...)``, ``session.connection(execution_options=...)``); or
    the driver's own autocommit set behind SQLAlchemy's back (``connect_args``), where the
    dialect can tell it (SQLAlchemy 2.1's ``Dialect.detect_autocommit_setting``). A
    connection whose driver is inside a transaction it began itself (SQLite's BEGIN
    recipe for SAVEPOINTs) is not. Attribute reads only: no round trip.
    """
    if isolation_autocommit(conn):
        return True
    driver = conn.connection.dbapi_connection
    if driver is None or getattr(driver, "in_transaction", False) is True:
        return False
    return driver_autocommits(conn.dialect, driver)


def isolation_autocommit(conn: Connection) -> bool:
    """SQLAlchemy's own test, private: the public ``get_execution_options()`` misses the
    engine-wide ``create_engine(isolation_level=...)``, and ``get_isolation_level()`` runs a
    query and never reports AUTOCOMMIT (SQLAlchemy's documentation of it)."""
    if _IS_AUTOCOMMIT is not None:
        return bool(_IS_AUTOCOMMIT(conn))
    return conn.get_execution_options().get("isolation_level") == AUTOCOMMIT


_IS_AUTOCOMMIT = getattr(Connection, "_is_autocommit_isolation", None)  # looked up once


def engine_autocommits(engine: Engine) -> bool:
    """``isolation_autocommit`` for a connection ``engine`` would make: known before it
    connects (an AsyncSession's send() cannot connect)."""
    level = engine.get_execution_options().get("isolation_level")
    if level is not None:
        return bool(level == AUTOCOMMIT)
    return getattr(engine.dialect, "_on_connect_isolation_level", None) == AUTOCOMMIT


def driver_autocommits(dialect: Dialect, driver: Any) -> bool:
    """The driver's autocommit as the dialect reads it; False where it cannot (SQLAlchemy
    before 2.1, or a dialect without the method)."""
    detect = getattr(dialect, "detect_autocommit_setting", None)
    if detect is None:
        return False
    try:
        return bool(detect(driver))
    except (NotImplementedError, AttributeError):  # AttributeError: an adapter without it
        return False


# The URL each AsyncEngine made here was asked for: asyncpg's engine URL has lost libpq's
# ``options`` (moved into server_settings), which the relay's sync engine still needs.
_given_urls: weakref.WeakKeyDictionary[AsyncEngine, URL] = weakref.WeakKeyDictionary()


def given_url(engine: AsyncEngine) -> URL:
    """The URL ``engine`` was made from by ``async_engine_from``, else its own.

    An app's own PostgreSQL AsyncEngine may set the search_path in ``connect_args``
    (asyncpg's ``server_settings``, psycopg's ``options``): it joins the URL's ``options``.
    """
    given = _given_urls.get(engine)
    if given is not None:
        return given
    url = engine.url
    if not dialect_for(url).schema_in_options or "options" in url.query:
        return url
    params = connect_params(engine.sync_engine)[1]
    if isinstance(params.get("options"), str):
        return url.update_query_dict({"options": params["options"]})
    path = search_path_setting(params)
    if path is None:
        return url
    return url.update_query_dict({"options": f"-csearch_path={libpq_escape(path)}"})


def async_engine_from(
    db: str | URL | AsyncEngine, connect_timeout_s: float = CONNECT_TIMEOUT_S, **kw: Any
) -> AsyncEngine:
    """An AsyncEngine for a database URL (a sync one gets its async driver), or the app's own.

    Without greenlet (the ``async`` extra) a ConfigError names the extra.
    """
    if aio.is_async_engine(db):
        return db
    aio.require()
    from sqlalchemy.ext.asyncio import create_async_engine

    try:
        url = async_url(with_driver(db))
        args = timeouts(url, connect_timeout_s, None)
        if url.get_driver_name() == "asyncpg" and "options" in url.query:
            args["server_settings"] = server_settings(str(url.query["options"]))
            url = url.difference_update_query(["options"])
        engine = create_async_engine(url, connect_args=args, **kw)
    except ImportError as exc:  # the driver: asyncpg, aiosqlite, asyncmy
        raise ConfigError(f"db: cannot use {mask_url(db)!r}: {exc} ({aio.INSTALL})") from None
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise unusable_url(db, exc) from None
    _given_urls[engine] = make_url(db)
    dialect_for(url).limit_reads(engine.sync_engine, url, None)
    return engine


def server_settings(options: str) -> dict[str, str]:
    """libpq's ``options`` (``-c name=value`` ...) as asyncpg's server_settings."""
    words = libpq_words(options)  # split as the server splits them, for libpq drivers
    settings = [w[2:] if w[:2] in ("-c", "--") else w for w in words if w != "-c"]
    if any("=" not in s for s in settings):
        raise ValueError(f"options: only -c name=value settings are supported, got {options!r}")
    return dict(s.split("=", 1) for s in settings)


def timeouts(url: URL, connect_s: float, read_s: float | None) -> dict[str, Any]:
    """The driver's own connect (and read) timeout arguments for ``url``'s backend."""
    return dialect_for(url).timeouts(url, connect_s, read_s)


def check_broker_url(broker: str | None) -> str | None:
    if broker is None:
        return None
    scheme = urlsplit(broker).scheme if isinstance(broker, str) else ""
    if scheme not in BROKER_SCHEMES:
        # memory:// included: a typo away from silently dropping messages (tests pass a
        # relay.testing.MemoryBroker instance instead)
        raise ConfigError(
            f"broker: {mask_url(str(broker))!r} has no supported scheme; "
            f"use one of {', '.join(s + '://' for s in BROKER_SCHEMES)}"
        )
    return broker


def with_query(db: str, **params: str) -> str:
    """The database URL with extra driver parameters (e.g. ``options``, ``application_name``)."""
    return make_url(db).update_query_dict(params).render_as_string(hide_password=False)


def schema_url(db: str, schema: str) -> str:
    """A PostgreSQL URL whose connections see only ``schema`` (search_path).

    ``schema`` must follow outbox.names' rule (ConfigError otherwise): it lands in libpq's
    ``options``, where a space would start another server option.
    """
    return with_query(db, options=f"-csearch_path={check_name('schema', schema)}")
