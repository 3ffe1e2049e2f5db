"""Schema migrations for the outbox's tables, shipped inside the package.

``upgrade(db)`` is what ``outbox migrate`` runs; it is idempotent and safe to run
from several processes at once on every backend: a lock serialises them (PostgreSQL
advisory lock, MariaDB ``GET_LOCK``, SQLite's write lock), and the later ones find
the schema at head. Given a ``Connection`` it runs inside the caller's transaction, as
an app's own Alembic revision needs (``migrate.upgrade(op.get_bind())``).

Two branches: the main line (label ``outbox``) and model B's table (label ``modelb``),
applied only by ``upgrade(db, model_b=True)`` (``outbox migrate --model-b``) or where the
database has that table already. Their version table is ``outbox_alembic_version``.

``include_object`` and ``include_name`` are Alembic hooks for an app's own env.py: its
autogenerate then leaves the outbox's tables alone (docs/alembic.md).
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeAlias

import alembic.context
import alembic.op
from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import Revision
from sqlalchemy import Connection, Engine, inspect
from sqlalchemy.exc import InvalidRequestError

from outbox.dialects import dialect_for
from outbox.engines import engine_from
from outbox.errors import OutboxError
from outbox.partitions import is_partition_name
from outbox.secrets import url_of
from outbox.table import metadata
from outbox.urls import with_driver

VERSION_TABLE = "outbox_alembic_version"
MESSAGE_TABLE = "outbox_message"
MODEL_B_TABLE = "outbox_transaction_record"
MAIN = "outbox"  # the main line's branch label: `outbox@head`
MODEL_B = "modelb"  # model B's branch label: `modelb@head`
# Every table the outbox owns: what an app's autogenerate must leave alone.
OWNED_TABLES = frozenset({*metadata.tables, VERSION_TABLE})
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


def upgrade(
    db: str | Engine | Connection, revision: str = "head", *, model_b: bool = False
) -> str | None:
    """Upgrade to ``revision``; a foreign ``outbox_message`` or a newer schema is refused.

    ``head`` is the main line's head, and model B's branch too where ``model_b`` is true
    or the database has model B's table already. Given a URL or an Engine, it commits
    its own transaction under the migration lock. Given a Connection, it runs inside
    the caller's transaction and commits nothing: the caller commits (MariaDB commits
    each DDL statement itself, whatever the caller does).

    Returns the revision(s) found before (None: no tables), read under the migration
    lock: of concurrent runs, only the one that upgraded sees the old revision.
    """
    with connected(db) as conn:
        problem = schema_problem(conn)
        if problem is not None and not problem.upgradable:
            raise problem
        target = target_of(conn, revision, model_b)
        return _run(command.upgrade, conn, target, caller=isinstance(db, Connection))


def downgrade(db: str | Engine | Connection, revision: str = "base") -> None:
    """Downgrade to ``revision`` (``base``: no outbox tables); a Connection as upgrade()."""
    with connected(db) as conn:
        _run(command.downgrade, conn, revision, caller=isinstance(db, Connection))


def target_of(conn: Connection, revision: str, model_b: bool) -> str:
    """The Alembic target ``revision`` means here: ``head`` takes model B's branch along
    where asked or where the database has its table (an old migrate made it)."""
    if revision != "head":
        return revision
    if model_b or inspect(conn).has_table(MODEL_B_TABLE):
        return "heads"
    return f"{MAIN}@head"


def upgrade_sql(url: str, revision: str = "head", *, model_b: bool = False) -> None:
    """Print the upgrade as SQL (Alembic's offline mode) instead of running it."""
    url = with_driver(url).render_as_string(hide_password=False)  # postgres://: psycopg's SQL
    if revision == "head":
        revision = "heads" if model_b else f"{MAIN}@head"
    command.upgrade(alembic_config(url), revision, sql=True)


def current_revision(db: str | Engine | Connection) -> str | None:
    """The schema's revision (``0009``; ``0009 + modelb_0001`` with model B's branch)."""
    with connected(db) as conn:
        return revision_of(conn)


@contextmanager
def connected(db: str | Engine | Connection) -> Iterator[Connection]:
    """A connection to ``db``; an engine made here from a URL is disposed afterwards."""
    if isinstance(db, Connection):
        yield db
        return
    engine = engine_from(db)
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        if engine is not db:
            engine.dispose()


def heads_of(conn: Connection) -> tuple[str, ...]:
    """The revisions in the version table: one per branch the database has."""
    context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return tuple(sorted(context.get_current_heads()))


def revision_of(conn: Connection) -> str | None:
    return " + ".join(heads_of(conn)) or None


class SchemaProblem(SchemaError):
    def __init__(self, message: str, upgradable: bool) -> None:
        super().__init__(message)
        self.upgradable = upgradable  # `outbox migrate` is the cure


def schema_problem(conn: Connection, model_b: bool = False) -> SchemaProblem | None:
    """What keeps this database's schema from being the one this package expects, if anything.

    Each case has its own cure, so each has its own message: no table (migrate), a
    table another tool made (not ours to touch), behind (migrate), ahead (upgrade).
    ``model_b``: model B's branch must be at its head too (`outbox migrate --model-b`).
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
    heads, script = heads_of(conn), script_directory()
    head = script.get_revision(f"{MAIN}@head")
    known = {r.revision for r in script.walk_revisions()}
    if newer := [h for h in heads if h not in known]:
        return SchemaProblem(
            f"the outbox schema in {where} is at revision {' + '.join(newer)}, newer than "
            f"this outbox-relay knows (head {head.revision}): upgrade outbox-relay",
            False,
        )
    done = applied(heads, script)
    if head.revision not in done:
        at = next((r for r, rev in done.items() if MODEL_B not in rev.branch_labels), "none")
        return SchemaProblem(
            f"the outbox schema in {where} is at revision {at}, this outbox-relay needs "
            f"{head.revision}: run `outbox migrate`",
            True,
        )
    model_b_head = script.get_revision(f"{MODEL_B}@head").revision
    if model_b and model_b_head not in done:
        return SchemaProblem(
            f"model B's branch of the outbox schema in {where} is not at {model_b_head} "
            f"(its table {MODEL_B_TABLE}): run `outbox migrate --model-b`",
            True,
        )
    return missing_columns(conn, where)


def script_directory() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def applied(heads: tuple[str, ...], script: ScriptDirectory) -> dict[str, Revision]:
    """Every revision the version table's heads stand for (their ancestors and what they
    depend on: a head of model B's branch may stand for the main line's 0002), newest
    first."""
    return {r.revision: r for r in script.iterate_revisions(heads, "base")} if heads else {}


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


def require_schema(db: str | Engine | Connection, model_b: bool = False) -> None:
    """Raise the schema's problem, if it has one, before a command relies on it."""
    with connected(db) as conn:
        problem = schema_problem(conn, model_b)
    if problem is not None:
        raise problem


@contextmanager
def migration_lock(conn: Connection, caller: bool = False) -> Iterator[None]:
    """Serialise migrations: a second `outbox migrate` waits, then finds the schema at head.

    ``caller``: the transaction is the caller's, so nothing here may commit or begin one:
    PostgreSQL's lock waits for the caller's COMMIT; SQLite's write lock is the caller's.
    """
    dialect = dialect_for(conn)  # PostgreSQL's advisory lock, SQLite's write lock, GET_LOCK
    if not dialect.lock_migrations(conn, caller, LOCK_WAIT_S):
        raise SchemaError(f"another `outbox migrate` held the lock for {LOCK_WAIT_S} s")
    if dialect.transactional_ddl:  # the lock ends with the transaction
        yield
        return
    # MariaDB commits each DDL statement: only a session-level named lock spans them.
    try:
        yield
        if not caller:
            conn.commit()  # the version row, before the next one reads it
    finally:
        dialect.unlock_migrations(conn)


def _run(cmd: object, conn: Connection, revision: str, caller: bool = False) -> str | None:
    """Run an Alembic command on ``conn``; the revision env.py found under the lock.

    ``caller``: inside the caller's transaction, which may be an app's own Alembic run.
    """
    if not caller:
        conn.rollback()  # the checks' reads: the migration starts its own transaction (and lock)
    config = alembic_config()
    config.attributes["connection"] = conn
    config.attributes["caller"] = caller
    with app_alembic_kept():
        cmd(config, revision)  # type: ignore[operator]
    if not caller:
        conn.commit()
    found: str | None = config.attributes.get("found")
    return found


@contextmanager
def app_alembic_kept() -> Iterator[None]:
    """Run from an app's revision, our Alembic run nests in the app's, and on leaving it
    removes the module proxies ``alembic.context`` and ``alembic.op`` (the app's too):
    they are put back, so that the app's revision and env.py go on."""
    proxies = [getattr(module, "_proxy", None) for module in (alembic.context, alembic.op)]
    try:
        yield
    finally:
        for proxy in proxies:
            if proxy is not None:
                proxy._install_proxy()


# Alembic's hooks, for an app's env.py (or Flask-Migrate's Migrate(..., include_object=)).
IncludeObject: TypeAlias = Callable[[Any, "str | None", str, bool, Any], bool]


def include_object(
    object: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic's ``include_object`` hook: False for the outbox's tables and for their
    columns, indexes and constraints; True for everything else (the app's own)."""
    if type_ == "table":
        return not owned(name)
    return not owned(table_of(object))


def include_name(name: str | None, type_: str, parent_names: Mapping[Any, str | None]) -> bool:
    """Alembic's ``include_name`` hook (what autogenerate reflects): False for the
    outbox's tables and for their columns, indexes and constraints; True otherwise."""
    if type_ == "schema":
        return True
    if type_ == "table":
        return not owned(name)
    return not owned(parent_names.get("table_name"))


def owned(table: str | None) -> bool:
    """A table the outbox owns: one of its own, or a partition of ``outbox_message``."""
    return table in OWNED_TABLES or is_partition_name(table)


def excluding_outbox(app_include_object: IncludeObject) -> IncludeObject:
    """The app's own ``include_object``, asked only about what is not the outbox's."""

    def hook(object: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        return include_object(object, name, type_, reflected, compare_to) and app_include_object(
            object, name, type_, reflected, compare_to
        )

    return hook


def table_of(item: object) -> str | None:
    """The name of the table a column, index or constraint belongs to, if any."""
    try:
        table = getattr(item, "table", None)
    except InvalidRequestError:  # a constraint attached to no table
        return None
    name = getattr(table, "name", None)
    return name if isinstance(name, str) else None
