"""Retention on each database: one day of sent rows purged, and what it leaves behind.

Run with `python -m bench.purge` (900,000 sent rows over three days) or `--rows N`. On
PostgreSQL (one table, and partitioned by day: outbox.partitions), MariaDB and SQLite,
each in a database or schema of its own: N sent rows spread evenly over the last three
days (UUIDv7 msg_ids of their time, as senders write them), then one retention pass
(relay.operator.Operator.purge, what `outbox purge` and the workers run) with a
retention that ends at yesterday's midnight (UTC): every row of the days before goes.
Figures: the pass's seconds and rows a second, and what the deleted rows leave for the
database to clean up afterwards:

- PostgreSQL: dead tuples (pg_stat_user_tables.n_dead_tup, over every partition) left
  for autovacuum, as a share of the rows removed; a dropped partition leaves none;
- MariaDB (InnoDB): the undo history the purge thread still has to remove (``History
  list length``) just after the pass, and the seconds until it is back to where it was;
- SQLite: the pages freed into the file's free list (the file does not shrink by itself).
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

from bench.fast_path import bench_schema
from bench.report import print_rows
from outbox import migrate, partitions
from outbox.settings import Settings
from relay import store
from relay.operator import Operator

MARIADB = os.environ.get("OUTBOX_TEST_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test")
DAY_S = 86400.0
HISTORY_WAIT_S = 120.0
# Sent rows of rising age (created_at, sent_at and msg_id's time), ids rising with time
# as senders write them: row ``g`` of ``top`` is ``(top - g) * step`` seconds old.
SEED_PG = """
    INSERT INTO outbox_message (msg_id, topic, payload, status, created_at, sent_at)
    SELECT (lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0') || '7'
            || substr(md5(g::text), 1, 19))::uuid,
           'bench.purge', convert_to(repeat('x', 200), 'UTF8'), 'sent', t, t
    FROM generate_series(CAST(:lo AS int), CAST(:hi AS int)) AS g,
         LATERAL (SELECT now() - (:top - g) * CAST(:step AS float8) * interval '1 second' AS t) s"""
SEED_MARIADB = """
    INSERT INTO outbox_message (msg_id, topic, payload, status, created_at, sent_at)
    SELECT concat(lpad(hex(floor(unix_timestamp(t) * 1000)), 12, '0'), '7',
                  substr(md5(seq), 1, 19)),
           'bench.purge', repeat('x', 200), 'sent', t, t
    FROM (SELECT seq, utc_timestamp(6) - interval (:top - seq) * :step second AS t
          FROM seq_{lo}_to_{hi}) s"""
SEED_SQLITE = """
    WITH RECURSIVE g(n) AS (SELECT :lo UNION ALL SELECT n + 1 FROM g WHERE n < :hi)
    INSERT INTO outbox_message (msg_id, topic, payload, status, created_at, sent_at)
    SELECT printf('%012x', CAST((julianday('now') - 2440587.5) * 86400000.0
                                - (:top - n) * :step * 1000 AS INTEGER))
           || '7' || substr(lower(hex(randomblob(10))), 1, 19),
           'bench.purge', zeroblob(200), 'sent',
           strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || ((:top - n) * :step) || ' seconds'),
           strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || ((:top - n) * :step) || ' seconds')
    FROM g"""
CHUNK = 100_000


@dataclass
class Result:
    seconds: float
    removed: int
    left: str  # what the database must still clean up
    after: str = ""  # how long that took, where measured


def seed(engine: Engine, rows: int, sql: str, formatted: bool = False) -> None:
    """``rows`` sent rows over the last three days, in chunks."""
    step = 3 * DAY_S / rows
    for lo in range(1, rows + 1, CHUNK):
        hi = min(lo + CHUNK - 1, rows)
        statement = sql.format(lo=lo, hi=hi) if formatted else sql
        with engine.begin() as conn:
            conn.execute(text(statement), {"lo": lo, "hi": hi, "top": rows, "step": step})


def retention_s(engine: Engine) -> float:
    """A retention that ends at the midnight (UTC) that began yesterday: the rows of the
    days before go, as whole days on a partitioned table and row by row on one table."""
    with engine.connect() as conn:
        now = store.db_clock(conn)
    yesterday = datetime(now.year, now.month, now.day, tzinfo=UTC) - timedelta(days=1)
    return (now - yesterday).total_seconds()


def purge(engine: Engine) -> tuple[float, int]:
    batch = Settings().purge_batch
    started = time.perf_counter()
    done = Operator(engine).purge(retention_s(engine), batch)
    return time.perf_counter() - started, done.rows


def postgresql(rows: int, partitioned: bool) -> Result:
    with bench_schema() as url:
        migrate.upgrade(url)
        engine = create_engine(url, poolclass=NullPool)
        if partitioned:
            partitions.convert(engine)
            partitions.ensure(engine, since=datetime.now(UTC).date() - timedelta(days=4))
        seed(engine, rows, SEED_PG)
        vacuum_pg(engine)
        seconds, removed = purge(engine)
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_stat_force_next_flush()"))
            dead = conn.execute(
                text(
                    "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables "
                    "WHERE schemaname = current_schema() AND relname LIKE 'outbox_message%'"
                )
            ).scalar_one()
        engine.dispose()
    share = 100.0 * int(dead) / removed if removed else 0.0
    return Result(seconds, removed, f"{int(dead):,} dead tuples ({share:.1f} %)")


def vacuum_pg(engine: Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE outbox_message"))


@contextmanager
def mariadb_database() -> Iterator[str]:
    name = f"bench_purge_{os.getpid()}"
    admin = create_engine(MARIADB, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}`"))
    try:
        yield MARIADB.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP DATABASE `{name}`"))
        admin.dispose()


def history_length(engine: Engine) -> int:
    with engine.connect() as conn:
        status = conn.execute(text("SHOW ENGINE INNODB STATUS")).one()[2]
    match = re.search(r"History list length (\d+)", status)
    return int(match.group(1)) if match else 0


def waited(until: Callable[[], bool], deadline_s: float) -> float | None:
    """Seconds until ``until()`` holds, polled; None when it did not within the deadline."""
    started = time.perf_counter()
    while time.perf_counter() - started < deadline_s:
        if until():
            return time.perf_counter() - started
        time.sleep(0.5)
    return None


def mariadb(rows: int) -> Result:
    with mariadb_database() as url:
        migrate.upgrade(url)
        engine = create_engine(url, poolclass=NullPool)
        seed(engine, rows, SEED_MARIADB, formatted=True)
        before = history_length(engine)
        seconds, removed = purge(engine)
        after = history_length(engine)
        took = waited(lambda: history_length(engine) <= before + 1000, HISTORY_WAIT_S)
        engine.dispose()
    back = f"{took:.0f} s" if took is not None else f"> {HISTORY_WAIT_S:.0f} s"
    left = f"{max(0, after - before):,} undo records to purge"
    return Result(seconds, removed, left, f"back to baseline in {back}")


def sqlite(rows: int) -> Result:
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{Path(folder) / 'outbox.sqlite'}"
        migrate.upgrade(url)
        engine = create_engine(url, poolclass=NullPool)
        seed(engine, rows, SEED_SQLITE)
        seconds, removed = purge(engine)
        with engine.connect() as conn:
            free = conn.execute(text("PRAGMA freelist_count")).scalar_one()
            pages = conn.execute(text("PRAGMA page_count")).scalar_one()
        engine.dispose()
    return Result(seconds, removed, f"{free:,} of {pages:,} pages free, file not shrunk")


def main() -> None:
    parser = argparse.ArgumentParser(description="one day's retention on each database")
    parser.add_argument("--rows", type=int, default=900_000, help="sent rows over 3 days")
    args = parser.parse_args()
    runs: dict[str, Callable[[], Result]] = {
        "PostgreSQL, one table": lambda: postgresql(args.rows, False),
        "PostgreSQL, partitioned": lambda: postgresql(args.rows, True),
        "MariaDB": lambda: mariadb(args.rows),
        "SQLite": lambda: sqlite(args.rows),
    }
    table = [("database", "removed", "seconds", "rows/s", "left to clean up", "")]
    for name, run in runs.items():
        print(
            f"{name}: seeding {args.rows:,} rows and purging the days before yesterday ...",
            flush=True,
        )
        result = run()
        rate = result.removed / result.seconds if result.seconds else 0.0
        table.append((name, f"{result.removed:,}", f"{result.seconds:.2f}", f"{rate:,.0f}",
                      result.left, result.after))  # fmt: skip
    print_rows(
        f"purge: the days before yesterday of {args.rows:,} sent rows over three days (one pass, "
        f"purge_batch {Settings().purge_batch:,}), {os.cpu_count()} CPUs",
        table,
    )


if __name__ == "__main__":
    main()
