"""Schema migrations for the outbox's tables, shipped inside the package.

``upgrade(db)`` is what ``outbox migrate`` runs; it is idempotent and safe to run
from several processes at once on every backend: a lock serialises them (PostgreSQL
advisory lock, MariaDB ``GET_LOCK``, SQLite's write lock), and the later ones find
the schema at head.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterator
from contextlib import contextmanager

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, inspect, text

from outbox.engines import engine_from
from outbox.errors import OutboxError
from outbox.secrets import url_of
from outbox.table import metadata
from outbox.urls import with_driver

VERSION_TABLE = "outbox_alembic_version"
MESSAGE_TABLE = "outbox_message"
# Any number taken only by us; serialises concurrent `outbox migrate` runs on PostgreSQL.
PG_LOCK_KEY = 0x0B0C5_2024
LOCK_WAIT_S = 120  # MariaDB: how long a migration waits for another one to finish


class SchemaError(OutboxError):
    """The database's outbox schema is missing, foreign, behind or ahead of this package."""


def alembic_config(db: str | Engine | None = None) -> Config:
    config = Config()
    # outbox.migrations is the repository's top-level migrations/ folder, installed under
    # outbox/ by the wheel: the import system knows where it is in either install.
    location = str(importlib.resources.files("outbox.migrations"))
    config.set_main_option("script_location", location.replace("%", "%%"))
    if isinstance(db, str):
        # ConfigParser interpolation would read a '%' in a password as a directive.
        config.set_main_option("sqlalchemy.url", db.replace("%", "%%"))
    return config


def upgrade(db: str | Engine, revision: str = "head") -> str | None:
    """Upgrade to ``revision``; a foreign ``outbox_message`` or a newer schema is refused.

    Returns the revision found before (None: no tables), read under the migration lock:
    of concurrent runs, only the one that upgraded sees the old revision.
    """
    with connected(db) as conn:
        problem = schema_problem(conn)
        if problem is not None and not problem.upgradable:
            raise problem
        return _run(command.upgrade, conn, revision)


def downgrade(db: str | Engine, revision: str = "base") -> None:
    with connected(db) as conn:
        _run(command.downgrade, conn, revision)


def upgrade_sql(url: str, revision: str = "head") -> None:
    """Print the upgrade as SQL (Alembic's offline mode) instead of running it."""
    url = with_driver(url).render_as_string(hide_password=False)  # postgres://: psycopg's SQL
    command.upgrade(alembic_config(url), revision, sql=True)


def current_revision(db: str | Engine) -> str | None:
    with connected(db) as conn:
        return revision_of(conn)


@contextmanager
def connected(db: str | Engine) -> Iterator[Connection]:
    """A connection to ``db``; an engine made here from a URL is disposed afterwards."""
    engine = engine_from(db)
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        if engine is not db:
            engine.dispose()


def revision_of(conn: Connection) -> str | None:
    context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


class SchemaProblem(SchemaError):
    def __init__(self, message: str, upgradable: bool) -> None:
        super().__init__(message)
        self.upgradable = upgradable  # `outbox migrate` is the cure


def schema_problem(conn: Connection) -> SchemaProblem | None:
    """What keeps this database's schema from being the one this package expects, if anything.

    Each case has its own cure, so each has its own message: no table (migrate), a
    table another tool made (not ours to touch), behind (migrate), ahead (upgrade).
    """
    where = url_of(conn.engine)
    names = set(inspect(conn).get_table_names())
    if MESSAGE_TABLE not in names:
        return SchemaProblem(f"no outbox tables in {where}: run `outbox migrate` first", True)
    if VERSION_TABLE not in names:
        return SchemaProblem(
            f"{where} has a table {MESSAGE_TABLE} that outbox-relay did not create (no "
            f"{VERSION_TABLE}); use another database or schema, or rename that table",
            False,
        )
    revision, script = revision_of(conn), ScriptDirectory.from_config(alembic_config())
    head = script.get_current_head()
    known = {r.revision for r in script.walk_revisions()}
    if revision is not None and revision not in known:
        return SchemaProblem(
            f"the outbox schema in {where} is at revision {revision}, newer than this "
            f"outbox-relay knows (head {head}): upgrade outbox-relay",
            False,
        )
    if revision != head:
        return SchemaProblem(
            f"the outbox schema in {where} is at revision {revision or 'none'}, this "
            f"outbox-relay needs {head}: run `outbox migrate`",
            True,
        )
    return missing_columns(conn, where)


def missing_columns(conn: Connection, where: str) -> SchemaProblem | None:
    have = {c["name"] for c in inspect(conn).get_columns(MESSAGE_TABLE)}
    missing = [c.name for c in metadata.tables[MESSAGE_TABLE].columns if c.name not in have]
    if not missing:
        return None
    return SchemaProblem(
        f"the table {MESSAGE_TABLE} in {where} lacks column(s) {', '.join(missing)}: it was "
        "changed by hand or by another tool; `outbox migrate` will not repair it",
        False,
    )


def require_schema(db: str | Engine) -> None:
    """Raise the schema's problem, if it has one, before a command relies on it."""
    with connected(db) as conn:
        problem = schema_problem(conn)
    if problem is not None:
        raise problem


@contextmanager
def migration_lock(conn: Connection) -> Iterator[None]:
    """Serialise migrations: a second `outbox migrate` waits, then finds the schema at head."""
    backend = conn.dialect.name
    if backend == "postgresql":  # released by the migration's COMMIT
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_LOCK_KEY})
    elif backend == "sqlite":  # the write lock, till COMMIT; the others wait their busy timeout
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    if backend not in ("mysql", "mariadb"):
        yield
        return
    # MariaDB commits each DDL statement: only a session-level named lock spans them.
    name = "LEFT(CONCAT('outbox_migrate.', DATABASE()), 64)"
    got = conn.execute(text(f"SELECT GET_LOCK({name}, :s)"), {"s": LOCK_WAIT_S}).scalar()
    if got != 1:
        raise SchemaError(f"another `outbox migrate` held the lock for {LOCK_WAIT_S} s")
    try:
        yield
        conn.commit()  # the version row, before the next one reads it
    finally:
        conn.execute(text(f"SELECT RELEASE_LOCK({name})"))


def _run(cmd: object, conn: Connection, revision: str) -> str | None:
    """Run an Alembic command on ``conn``; the revision env.py found under the lock."""
    conn.rollback()  # the checks' reads: the migration starts its own transaction (and lock)
    config = alembic_config()
    config.attributes["connection"] = conn
    cmd(config, revision)  # type: ignore[operator]
    conn.commit()
    found: str | None = config.attributes.get("found")
    return found
