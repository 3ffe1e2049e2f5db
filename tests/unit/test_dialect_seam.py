"""The dialect seam: one ``outbox.dialects.Dialect`` per database owns every choice that
depends on it, and no other module of ``outbox`` (its migrations too) or ``relay`` asks
which database it is on.

The scan reads the source as tokens (comments and docstrings are not code, and a URL is
not a dialect's name); each Dialect's statements are compiled for its own backend.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    MetaData,
    String,
    Table,
    Uuid,
    create_engine,
    literal,
    select,
)
from sqlalchemy.dialects import mysql, postgresql
from sqlalchemy.dialects.mysql.mariadb import MariaDBDialect
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool, QueuePool

from outbox.dialects import (
    DIALECTS,
    MYSQL,
    POSTGRESQL,
    SQLITE,
    Dialect,
    MySQL,
    PostgreSQL,
    SQLite,
    dialect_for,
)
from outbox.table import db_now, db_now_plus, outbox_message, session_now

ROOT = Path(__file__).resolve().parents[2]
DIALECT_NAMES = {"postgresql", "postgres", "mysql", "mariadb", "sqlite"}
# String literals that spell a dialect's name for another reason: (module, literal, why).
ALLOWED = {
    ("relay/cli/__init__.py", "mysql"),  # the pip extra outbox-relay[mysql] of PyMySQL
}
SQLA = {
    "postgresql": postgresql.dialect(),  # type: ignore[no-untyped-call]
    "mysql": mysql.dialect(),
    "sqlite": create_engine("sqlite://").dialect,
}


def product_modules() -> Iterator[Path]:
    for package in ("outbox", "relay", "migrations"):  # migrations/ installs as outbox.migrations
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_relative_to(ROOT / "outbox" / "dialects"):
                continue
            yield path


def dialect_questions(source: str) -> Iterator[tuple[int, str]]:
    """(line, what) for each place ``source`` asks which database it is on: a string
    literal that is a dialect's name (compared, or keyed on), ``.dialect.name``, or a
    comparison of ``get_backend_name()``."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    code = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in skip]
    for i, token in enumerate(code):
        after = [t.string for t in code[i + 1 : i + 5]]
        if token.type == tokenize.STRING:
            value = _literal(token.string)
            if isinstance(value, str) and value.lower() in DIALECT_NAMES:
                yield token.start[0], value
        elif token.string == "dialect" and after[:2] == [".", "name"]:
            yield token.start[0], "dialect.name"
        elif token.string == "get_backend_name" and after[2:3] in (["=="], ["!="], ["in"], ["not"]):
            yield token.start[0], "get_backend_name() compared"


def _literal(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):  # an f-string
        return None


def test_no_product_module_asks_which_database_it_is_on() -> None:
    found = []
    for path in product_modules():
        module = path.relative_to(ROOT).as_posix()
        for line, what in dialect_questions(path.read_text()):
            if (module, what) not in ALLOWED:
                found.append(f"{module}:{line}: {what}")
    assert found == [], "ask outbox.dialects.dialect_for(...) instead"


def test_the_scan_sees_each_way_of_asking() -> None:
    source = '''
"""Docs may say postgresql, and URLs postgresql://h/db are fine."""
url = "postgresql+psycopg://h/db"  # a comment about "mysql"
a = conn.dialect.name == "sqlite"
b = url.get_backend_name() in ("mysql", "mariadb")
c = make_url(url).get_backend_name()
'''
    assert [what for _, what in dialect_questions(source)] == [
        "dialect.name",
        "sqlite",
        "get_backend_name() compared",
        "mysql",
        "mariadb",
    ]


# dialect_for


def test_dialect_for_every_kind_of_bind_gives_the_one_instance() -> None:
    engine = create_engine("sqlite://")
    with engine.connect() as conn, Session(engine) as session:
        binds = [engine, conn, session, engine.dialect, engine.url, "sqlite"]
        assert all(dialect_for(bind) is SQLITE for bind in binds)
    assert dialect_for(make_url("postgresql+asyncpg://h/db")) is POSTGRESQL
    assert dialect_for(MariaDBDialect()) is MYSQL
    assert dialect_for("mariadb") is dialect_for("mysql") is MYSQL


def test_a_database_not_supported_gets_a_base_dialect_of_its_name() -> None:
    other = dialect_for("oracle")
    assert type(other) is Dialect and other.name == "oracle"
    assert dialect_for("oracle") is other  # cached
    assert not other.supports_skip_locked and not other.binds_arrays
    assert other.timeouts(make_url("oracle://h/db"), 5, None) == {}
    with pytest.raises(NotImplementedError):
        other.insert_ignoring(outbox_message, outbox_message.c.msg_id)


def test_each_dialect_serves_its_names() -> None:
    assert [type(d) for d in DIALECTS] == [PostgreSQL, MySQL, SQLite]
    assert {n for d in DIALECTS for n in d.names} == {"postgresql", "mysql", "mariadb", "sqlite"}


# Capabilities

CAPABILITIES = {
    # name: (PostgreSQL, MySQL/MariaDB, SQLite)
    "supports_skip_locked": (True, True, False),
    "supports_upsert_returning": (True, False, True),
    "binds_arrays": (True, False, False),
    "percentiles_in_sql": (True, False, False),
    "transactional_ddl": (True, False, True),
    "stores_zone": (True, False, False),
    "free_autocommit": (True, False, False),
    "stale_locking_reads": (False, True, False),
    "file_database": (False, False, True),
    "schema_in_options": (True, False, False),
    "schema_is_database": (False, True, False),
    "alters_by_batch": (False, False, True),
    "supports_partial_indexes": (True, False, True),
    "brin_indexes": (True, False, False),
    "local_session_clock": (False, True, False),
}


@pytest.mark.parametrize("capability", list(CAPABILITIES))
def test_capabilities(capability: str) -> None:
    assert tuple(getattr(d, capability) for d in DIALECTS) == CAPABILITIES[capability]


def test_connection_choices() -> None:
    assert (POSTGRESQL.own_poolclass, MYSQL.own_poolclass, SQLITE.own_poolclass) == (
        QueuePool,
        QueuePool,
        NullPool,
    )
    assert [d.fresh_reads_isolation for d in DIALECTS] == [None, "READ COMMITTED", None]
    assert [d.reading_setup for d in DIALECTS] == [("SET LOCAL jit = off",), (), ()]
    assert [d.default_port for d in DIALECTS] == [5432, 3306, None]
    assert [d.async_driver for d in DIALECTS] == ["psycopg", "asyncmy", "aiosqlite"]
    assert MYSQL.target_backend == "mysql" == dialect_for("mariadb").target_backend


def test_timeouts_per_driver() -> None:
    pg, my, lite = (
        make_url(u) for u in ("postgresql+psycopg://h/d", "mysql+pymysql://h/d", "sqlite:///f")
    )
    assert POSTGRESQL.timeouts(pg, 0.5, None) == {"connect_timeout": 2}
    assert POSTGRESQL.timeouts(pg, 3, 1.5) == {
        "connect_timeout": 3,
        "options": "-c statement_timeout=1500",
    }
    asyncpg = pg.set(drivername="postgresql+asyncpg")
    assert POSTGRESQL.timeouts(asyncpg, 1.5, None) == {"timeout": 1.5}
    assert MYSQL.timeouts(my, 1.5, 30) == {
        "connect_timeout": 1.5,
        "read_timeout": 1.5,
        "write_timeout": 30,
    }
    asyncmy = my.set(drivername="mysql+asyncmy")
    assert MYSQL.timeouts(asyncmy, 1.5, 30) == {"connect_timeout": 1.5, "read_timeout": 1.5}
    assert MYSQL.timeouts(my.set(drivername="mysql+aiomysql"), 1.5, 30) == {"connect_timeout": 1.5}
    assert SQLITE.timeouts(lite, 1.5, None) == {"timeout": 1.5}
    assert SQLITE.timeouts(lite.update_query_dict({"timeout": "9"}), 1.5, None) == {}


def test_in_memory_sqlite() -> None:
    assert SQLITE.in_memory(make_url("sqlite://"))
    assert SQLITE.in_memory(make_url("sqlite:///file::memory:?cache=shared&uri=true"))
    assert not SQLITE.in_memory(make_url("sqlite:///app.db"))
    assert not SQLITE.driver_change_refused(make_url("sqlite:///app.db"))
    assert SQLITE.driver_change_refused(make_url("sqlite:///:memory:"))
    assert not POSTGRESQL.in_memory(make_url("postgresql://h/d"))


# Time and types


def compiled(statement: object, backend: str) -> str:
    return str(statement.compile(dialect=SQLA[backend]))  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("backend", "now", "plus", "session"),
    [
        (
            "postgresql",
            "statement_timestamp()",
            "INTERVAL '1 microsecond'",
            "statement_timestamp()",
        ),
        ("mysql", "(UTC_TIMESTAMP(6))", "MICROSECOND)", "CURRENT_TIMESTAMP(6)"),
        ("sqlite", "strftime('%Y-%m-%d %H:%M:%f', 'now')", "printf('%+.3f seconds'", "strftime("),
    ],
)
def test_the_clock_per_dialect(backend: str, now: str, plus: str, session: str) -> None:
    assert now in compiled(select(db_now()), backend)
    assert plus in compiled(select(db_now_plus(literal(5))), backend)
    assert session in compiled(select(session_now()), backend)


def test_times_bound_without_a_zone_where_the_column_keeps_none() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert POSTGRESQL.bind_time(at) == at and POSTGRESQL.bind_time(at).tzinfo is UTC
    assert MYSQL.bind_time(at).tzinfo is None is SQLITE.bind_time(at).tzinfo
    assert str(MYSQL.datetime_type().compile(dialect=SQLA["mysql"])) == "DATETIME(6)"


def test_column_types_per_dialect() -> None:
    table = outbox_message
    assert "INTEGER NOT NULL" in str(compiled_ddl(table, "sqlite"))
    assert "BIGINT" in str(compiled_ddl(table, "postgresql"))
    mariadb = compiled_ddl(table, "mysql")
    assert "COLLATE utf8mb4_bin" in mariadb and "LONGBLOB" in mariadb
    assert MYSQL.column_type("id") is None and SQLITE.column_type("payload") is None


def compiled_ddl(table: Table, backend: str) -> str:
    from sqlalchemy.schema import CreateTable

    return str(CreateTable(table).compile(dialect=SQLA[backend]))


# SQL variants

counters = Table(
    "counters",
    MetaData(),
    Column("k", String(10), primary_key=True),
    Column("n", BigInteger(), nullable=False),
)
rows = Table("rows", MetaData(), Column("id", Integer(), primary_key=True), Column("u", Uuid()))


def test_insert_ignoring_a_duplicate_key() -> None:
    assert "ON CONFLICT (u) DO NOTHING" in compiled(
        POSTGRESQL.insert_ignoring(rows, rows.c.u), "postgresql"
    )
    assert "ON CONFLICT (u) DO NOTHING" in compiled(
        SQLITE.insert_ignoring(rows, rows.c.u), "sqlite"
    )
    assert "ON DUPLICATE KEY UPDATE u = `rows`.u" in compiled(
        MYSQL.insert_ignoring(rows, rows.c.u), "mysql"
    )


def test_upsert_adding_to_a_total() -> None:
    for dialect in (POSTGRESQL, SQLITE):
        sql = compiled(dialect.upsert_adding(counters, [counters.c.k], counters.c.n), dialect.name)
        assert "ON CONFLICT (k) DO UPDATE SET n = (counters.n + excluded.n)" in sql
        assert "RETURNING" in sql
    sql = compiled(MYSQL.upsert_adding(counters, [counters.c.k], counters.c.n), "mysql")
    assert "ON DUPLICATE KEY UPDATE n = (counters.n + VALUES(n))" in sql
    assert "RETURNING" not in sql


def test_arrays_as_a_derived_table_on_postgresql_only() -> None:
    arrays = POSTGRESQL.rows_of_arrays("acked", [("k", "ks", Uuid()), ("r", "rs", String())])
    sql = compiled(select(arrays.c.k, arrays.c.r), "postgresql")
    assert "unnest(%(ks)s::UUID[], %(rs)s::VARCHAR[]) AS acked(k, r)" in sql
    for dialect in (MYSQL, SQLITE):
        with pytest.raises(NotImplementedError):
            dialect.rows_of_arrays("acked", [("k", "ks", Uuid())])


def test_per_minute_percentiles_on_postgresql_only() -> None:
    t = outbox_message
    query = select(
        POSTGRESQL.minute_of(t.c.sent_at),
        POSTGRESQL.percentile(0.5, POSTGRESQL.millis_between(t.c.created_at, t.c.sent_at)),
    )
    sql = compiled(query, "postgresql")
    assert "date_trunc(" in sql and "WITHIN GROUP (ORDER BY EXTRACT(epoch FROM" in sql
    for dialect in (MYSQL, SQLITE):
        with pytest.raises(NotImplementedError):
            dialect.minute_of(t.c.sent_at)


def test_statements_are_built_once_per_dialect() -> None:
    def build(dialect: Dialect) -> object:
        return dialect.insert_ignoring(rows, rows.c.u)

    assert POSTGRESQL.built(build) is POSTGRESQL.built(build)
    assert POSTGRESQL.built(build) is not SQLITE.built(build)


def test_partial_indexes_where_they_exist() -> None:
    assert set(POSTGRESQL.partial_index_kw("x")) == {"postgresql_where"}
    assert set(SQLITE.partial_index_kw("x")) == {"sqlite_where"}
    assert MYSQL.partial_index_kw("x") == {}
    only = POSTGRESQL.only_index("ix_t_brin", "created_at", using="brin")
    assert only._ddl_if is not None and only._ddl_if.dialect == "postgresql"
