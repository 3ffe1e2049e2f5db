"""The migrations create the schema outbox/table.py describes, on every supported database."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.pool import NullPool

from outbox import migrate
from outbox.table import metadata

ROOT = Path(__file__).resolve().parents[2]
# What a plain `outbox migrate` makes: model B's table only with --model-b.
OUTBOX_TABLES = {"outbox_message", "outbox_sequence", "outbox_inbox", migrate.VERSION_TABLE}


def tables(url: str) -> set[str]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def schema_diff(url: str, model_b: bool = False) -> list[object]:
    """Where the migrated schema and outbox/table.py differ (model B's table is expected
    only with ``model_b``)."""
    engine = create_engine(url, poolclass=NullPool)
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "version_table": migrate.VERSION_TABLE}
        )
        diff = compare_metadata(context, metadata)
        dialect = conn.dialect.name
    engine.dispose()
    return [d for d in diff if not (d[0] == "remove_table" and d[1].name == migrate.VERSION_TABLE)
            and not other_dialects(d, dialect) and (model_b or not model_b_table(d))]  # fmt: skip


def model_b_table(change: tuple) -> bool:  # type: ignore[type-arg]
    return change[0] == "add_table" and change[1].name == migrate.MODEL_B_TABLE


def other_dialects(change: tuple, dialect: str) -> bool:  # type: ignore[type-arg]
    """An index the model makes on another database only (``Index.ddl_if``, which
    Alembic's comparison does not read), so the migrations make none here."""
    if change[0] != "add_index":
        return False
    # Alembic compares copies of the model's tables: the model's own index has the rule
    table = metadata.tables[change[1].table.name]
    [model] = [i for i in table.indexes if i.name == change[1].name]
    only = model._ddl_if
    return only is not None and only.dialect not in (None, dialect)


def test_upgrade_downgrade_upgrade(any_db: str) -> None:
    migrate.upgrade(any_db)
    assert tables(any_db) == OUTBOX_TABLES
    assert migrate.current_revision(any_db) == "0011"
    migrate.downgrade(any_db)
    assert tables(any_db) == {migrate.VERSION_TABLE}
    assert migrate.current_revision(any_db) is None
    migrate.upgrade(any_db)
    assert tables(any_db) == OUTBOX_TABLES


def test_models_and_migrated_schema_agree(any_db: str) -> None:
    migrate.upgrade(any_db)
    assert schema_diff(any_db) == []
    assert [d[0] for d in schema_diff(any_db, model_b=True)] == ["add_table"]  # type: ignore[index]
    migrate.upgrade(any_db, model_b=True)
    assert schema_diff(any_db, model_b=True) == []


def test_diff_check_can_fail(sqlite_url: str) -> None:
    """Guards the test above: a schema missing an index must show up as a difference."""
    migrate.upgrade(sqlite_url)
    engine = create_engine(sqlite_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_outbox_message_pending"))
    engine.dispose()
    assert [d[0] for d in schema_diff(sqlite_url)] == ["add_index"]  # type: ignore[index]


def test_upgrade_leaves_app_tables_alone(pg_url: str) -> None:
    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE app_orders (id int primary key)"))
        conn.execute(text("CREATE TABLE alembic_version (version_num varchar(32) primary key)"))
        conn.execute(text("INSERT INTO alembic_version VALUES ('app_rev_1')"))
    migrate.upgrade(pg_url)
    with engine.connect() as conn:
        assert (
            conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
            == "app_rev_1"
        )
    engine.dispose()
    assert tables(pg_url) == OUTBOX_TABLES | {"app_orders", "alembic_version"}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    outbox = Path(sys.executable).with_name("outbox")
    return subprocess.run(
        [str(outbox), *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def test_cli_migrate_is_idempotent(pg_url: str) -> None:
    first = run_cli("migrate", "--db", pg_url)
    assert first.returncode == 0, first.stderr
    assert "outbox schema upgraded none -> 0011" in first.stdout
    second = run_cli("migrate", "--db", pg_url)
    assert second.returncode == 0, second.stderr
    assert "outbox schema already at 0011" in second.stdout
    assert tables(pg_url) == OUTBOX_TABLES


def test_cli_migrate_reads_outbox_db(sqlite_url: str) -> None:
    done = run_cli("migrate", env={**os.environ, "OUTBOX_DB": sqlite_url})
    assert done.returncode == 0, done.stderr
    assert tables(sqlite_url) == OUTBOX_TABLES


def test_cli_migrate_errors_are_one_clear_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_DB"}
    missing = run_cli("migrate", env=env)
    assert missing.returncode == 2 and "--db is required" in missing.stderr
    down = run_cli("migrate", "--db", "postgresql+psycopg://u:s3cret@127.0.0.1:1/x", env=env)
    assert down.returncode == 1
    assert down.stderr.startswith("outbox migrate: OperationalError")
    assert "Traceback" not in down.stderr and "s3cret" not in down.stderr
    bad = run_cli("migrate", "--db", "nosuchdb://x", env=env)
    assert bad.returncode == 2 and "db: cannot use" in bad.stderr  # a bad value: usage


def test_cli_migrate_sql_prints_ddl() -> None:
    done = run_cli("migrate", "--db", "postgresql+psycopg://x@localhost/y", "--sql")
    assert done.returncode == 0, done.stderr
    assert "CREATE TABLE outbox_message" in done.stdout
    assert "WHERE status = 'pending'" in done.stdout


def test_migrate_works_from_a_wheel(tmp_path: Path, sqlite_url: str) -> None:
    """Built and installed as a wheel, away from the checkout, `outbox migrate` still works."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("outbox_relay-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in ("env.py", "script.py.mako", "versions/0001_outbox_message.py"):
        assert f"outbox/migrations/{shipped}" in names
    assert not [n for n in names if n.startswith("migrations/")], "no top-level package"
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    code = (
        "import outbox, sys; from relay.cli import main;"
        f"assert outbox.__file__.startswith({str(target)!r}), outbox.__file__;"
        f"sys.exit(main(['migrate', '--db', {sqlite_url!r}]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert tables(sqlite_url) == OUTBOX_TABLES
