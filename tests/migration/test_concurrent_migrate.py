"""Several pods start at once: concurrent `outbox migrate` runs on a fresh database all succeed.

A bug shows as a run exiting 1 ("Table ... already exists", a duplicate version row),
or as a schema that is not at head, or at head twice (two version rows).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from outbox import migrate
from tests.migration.test_migrations import OUTBOX_TABLES, schema_diff, tables

OUTBOX = str(Path(sys.executable).with_name("outbox"))
RUNS = 8


def migrate_at_once(db: str) -> list[subprocess.CompletedProcess[str]]:
    procs = [
        subprocess.Popen(
            [OUTBOX, "migrate", "--db", db],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(RUNS)
    ]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def versions(db: str) -> list[str]:
    engine = create_engine(db, poolclass=NullPool)
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT version_num FROM {migrate.VERSION_TABLE}")).scalars()
        found = list(rows)
    engine.dispose()
    return found


def check_all_succeeded(db: str) -> None:
    runs = migrate_at_once(db)
    failed = [r.stderr for r in runs if r.returncode != 0]
    assert failed == [], failed
    said = sorted("upgraded none -> 0011" in r.stdout for r in runs)
    assert said == [False] * (len(runs) - 1) + [True], [r.stdout for r in runs]  # one did it
    assert all("-> 0011" in r.stdout or "already at 0011" in r.stdout for r in runs)
    assert versions(db) == ["0011"], "the schema is at head, once"
    assert tables(db) == OUTBOX_TABLES
    assert schema_diff(db) == []


def test_concurrent_migrate_on_postgresql(pg_url: str) -> None:
    check_all_succeeded(pg_url)


def test_concurrent_migrate_on_mariadb(mariadb_url: str) -> None:
    check_all_succeeded(mariadb_url)


def test_concurrent_migrate_on_sqlite(sqlite_url: str) -> None:
    check_all_succeeded(sqlite_url)
