"""Model B's table (outbox_transaction_record) on its own branch: a plain `outbox migrate`
makes no such table; `--model-b`, `outbox compare` and the listener do; a database an
earlier outbox-relay migrated keeps it, rows and all."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import Column, MetaData, String, Table, Uuid, create_engine, text
from sqlalchemy.pool import NullPool

from outbox import migrate
from outbox.table import session_now, time_type
from tests.migration.test_migrations import OUTBOX_TABLES, run_cli, schema_diff, tables

MODEL_B = migrate.MODEL_B_TABLE
BOTH = "0011 + modelb_0001"
INSERT_RECORD = (
    f"INSERT INTO {MODEL_B} (transaction_id, producer_group, msg_id) VALUES (:t, 'g', :m)"
)


def at_old_0002(url: str) -> None:
    """A database an earlier outbox-relay took to 0002, when 0002 made model B's table."""
    migrate.upgrade(url, "0002")
    old = Table(
        MODEL_B,
        MetaData(),
        Column("transaction_id", String(64), primary_key=True),
        Column("producer_group", String(255), nullable=False),
        Column("msg_id", Uuid(), nullable=False),
        Column("created_at", time_type, nullable=False, server_default=session_now()),
    )
    engine = create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        old.create(conn)
    engine.dispose()


def records(url: str) -> list[str]:
    engine = create_engine(url, poolclass=NullPool)
    with engine.connect() as conn:
        found = list(conn.execute(text(f"SELECT transaction_id FROM {MODEL_B}")).scalars())
    engine.dispose()
    return found


def test_a_plain_migrate_makes_no_model_b_table(any_db: str) -> None:
    migrate.upgrade(any_db)
    assert MODEL_B not in tables(any_db)
    assert migrate.current_revision(any_db) == "0011"
    migrate.require_schema(any_db)  # model A needs nothing more
    with pytest.raises(migrate.SchemaProblem, match="run `outbox migrate --model-b`") as found:
        migrate.require_schema(any_db, model_b=True)
    assert found.value.upgradable


def test_migrate_model_b_makes_it(any_db: str) -> None:
    assert migrate.upgrade(any_db, model_b=True) is None
    assert tables(any_db) == OUTBOX_TABLES | {MODEL_B}
    assert migrate.current_revision(any_db) == BOTH
    migrate.require_schema(any_db, model_b=True)
    assert schema_diff(any_db, model_b=True) == []
    assert migrate.upgrade(any_db) == BOTH  # a plain migrate keeps the branch
    assert migrate.current_revision(any_db) == BOTH


def test_the_cli_flag(pg_url: str) -> None:
    plain = run_cli("migrate", "--db", pg_url)
    assert plain.returncode == 0, plain.stderr
    assert MODEL_B not in tables(pg_url)
    done = run_cli("migrate", "--db", pg_url, "--model-b")
    assert done.returncode == 0, done.stderr
    assert f"outbox schema upgraded 0011 -> {BOTH}" in done.stdout
    again = run_cli("migrate", "--db", pg_url)
    assert f"outbox schema already at {BOTH}" in again.stdout
    assert MODEL_B in tables(pg_url)
    mixed = run_cli("migrate", "--db", pg_url, "--model-b", "--revision", "0005")
    assert mixed.returncode == 2 and "--model-b" in mixed.stderr


def test_the_sql_has_model_b_only_when_asked() -> None:
    url = "postgresql+psycopg://x@localhost/y"
    plain = run_cli("migrate", "--db", url, "--sql")
    with_b = run_cli("migrate", "--db", url, "--sql", "--model-b")
    assert plain.returncode == 0 and with_b.returncode == 0, plain.stderr + with_b.stderr
    assert "CREATE TABLE outbox_message" in plain.stdout
    assert f"CREATE TABLE {MODEL_B}" not in plain.stdout
    assert f"CREATE TABLE {MODEL_B}" in with_b.stdout


def test_an_old_database_keeps_its_table_and_rows(any_db: str) -> None:
    """Migrated to 0011 by an earlier outbox-relay, with model B's table made by 0002 and
    a row in it: it keeps working as it is, and the next migrate adopts the table."""
    at_old_0002(any_db)
    engine = create_engine(any_db, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(
            text(INSERT_RECORD),
            {"t": "tx1", "m": uuid.uuid4().hex},
        )
    engine.dispose()
    migrate.upgrade(any_db, "0011")  # as the earlier release's `outbox migrate` did
    assert migrate.current_revision(any_db) == "0011"
    migrate.require_schema(any_db)  # at head for model A: fine as it is

    assert migrate.upgrade(any_db) == "0011"  # a plain migrate adopts the table
    assert migrate.current_revision(any_db) == BOTH
    assert records(any_db) == ["tx1"]
    migrate.require_schema(any_db, model_b=True)
    assert schema_diff(any_db, model_b=True) == []


def test_an_old_database_at_0002_goes_to_both_heads(any_db: str) -> None:
    at_old_0002(any_db)
    migrate.upgrade(any_db)
    assert migrate.current_revision(any_db) == BOTH
    assert schema_diff(any_db, model_b=True) == []


def test_downgrades(sqlite_url: str) -> None:
    """Down to 0002 keeps model B's table (0002 was its revision); down to 0001 drops it,
    whether the branch made it or an old 0002 did."""
    migrate.upgrade(sqlite_url, model_b=True)
    migrate.downgrade(sqlite_url, "0002")
    assert MODEL_B in tables(sqlite_url)
    migrate.downgrade(sqlite_url, "0001")
    assert MODEL_B not in tables(sqlite_url)
    migrate.downgrade(sqlite_url)
    at_old_0002(sqlite_url)
    migrate.downgrade(sqlite_url, "0001")
    assert tables(sqlite_url) == {"outbox_message", migrate.VERSION_TABLE}


def test_a_listener_makes_its_table(sqlite_url: str) -> None:
    from relay.lab.halfop import SqlTransactionListener

    migrate.upgrade(sqlite_url)
    listener = SqlTransactionListener(sqlite_url, lambda session, msg, arg: None)
    listener.engine.dispose()
    assert migrate.current_revision(sqlite_url) == BOTH
    assert MODEL_B in tables(sqlite_url)
