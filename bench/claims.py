"""Claims benchmark: the sweeper's, the scheduler's and the drain's claim of one batch,
for growing backlogs (issue 40, item 5).

Run with `python -m bench.claims` (20,000 and 200,000 rows) or `--sizes 20000,1000000`.
Each size N: a fresh PostgreSQL schema holding N pending rows older than the sweeper
age, N scheduled rows due, and N/10 ordered rows in 10 keys, 2 of them blocked behind a
dead head (their rows the oldest), written with INSERT ... SELECT and VACUUM ANALYZEd.
Then ``--batches`` batches of each claim, as the relay runs them (relay.sweep.claims
Claimer, relay.sweep.scheduler Reading), each claimed, marked sent and committed, so the
claims move through the backlog; figures: the median and the least claim time (ms) at
the smallest and the largest size, and their ratios (the least is the steadier figure
on a loaded machine), and the shared buffers one more batch's locking statements touch
(EXPLAIN (ANALYZE, BUFFERS)): what a batch reads, whatever the machine's load. A claim
that reads the backlog grows with N; target: the largest size within 1/0.8 = 1.25x of
the smallest. ``one statement`` is the sweeper's claim of
before revision 0010 (claim_due_stmt: every row by age, ordered ones asked whether each
is its key's head), on the same table: it reads every blocked row each batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, text, update
from sqlalchemy.pool import NullPool

from bench.fast_path import bench_schema
from bench.report import print_rows
from outbox import migrate
from outbox.settings import Settings
from outbox.table import SENT, db_now, outbox_message
from relay import store
from relay.sweep.claims import Claimer, Cursor
from relay.sweep.scheduler import Reading

LIMIT = 500
AGE_S = 10.0
KEYS, BLOCKED = 10, 2
SEED = [
    """INSERT INTO outbox_message (msg_id, topic, payload, created_at)
       SELECT gen_random_uuid(), 'claims.n', convert_to('{"n": ' || g || '}', 'UTF8'),
              now() - interval '1 hour' + make_interval(secs => g / 1000.0)
       FROM generate_series(1, :rows) AS g""",
    """INSERT INTO outbox_message (msg_id, topic, payload, created_at, deliver_at)
       SELECT gen_random_uuid(), 'claims.later', '\\x7b7d'::bytea, now() - interval '2 hours',
              now() - interval '1 hour' + make_interval(secs => g / 1000.0)
       FROM generate_series(1, :rows) AS g""",
    """INSERT INTO outbox_message (msg_id, topic, key, seq, payload, created_at, status)
       SELECT gen_random_uuid(), 'claims.ordered', 'k' || (g % :keys), (g - 1) / :keys + 1,
              '\\x7b7d'::bytea,
              now() - CASE WHEN g % :keys < :blocked THEN interval '3 hours'
                           ELSE interval '2 hours' END + make_interval(secs => g / 1000.0),
              CASE WHEN g % :keys < :blocked AND g <= :keys THEN 'dead' ELSE 'pending' END
       FROM generate_series(1, :ordered) AS g""",
]
Claim = Callable[[Connection], list[store.Claimed]]


def seed(engine: Engine, rows: int) -> None:
    params = {"rows": rows, "keys": KEYS, "blocked": BLOCKED, "ordered": rows // 10}
    with engine.begin() as conn:
        for statement in SEED:
            conn.execute(text(statement), params)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE outbox_message"))


def claims() -> dict[str, Claim]:
    """Each claim a batch as the relay takes it (fresh Claimer and Cursor per size)."""
    claimer, cursor = Claimer(Settings(sweep_batch=LIMIT)), Cursor()

    def one_statement(conn: Connection) -> list[store.Claimed]:
        now = store.db_clock(conn)
        stmt = store.claim_due_stmt(now - timedelta(seconds=AGE_S), now, LIMIT)
        return store.claim(conn, stmt)

    return {
        "sweeper": lambda conn: claimer.claim(conn, AGE_S, True, None),
        "scheduler": Reading(LIMIT).claim,
        "drain": lambda conn: claimer.claim(conn, AGE_S, False, cursor),
        "one statement": one_statement,
    }


def batch_ms(engine: Engine, claim: Claim, batches: int) -> tuple[float, float]:
    """The median and the least time of ``batches`` claims, each batch then marked sent
    and committed (the least: what the claim costs when the machine lets it)."""
    times = []
    for _ in range(batches):
        with engine.begin() as conn:
            started = time.perf_counter()
            rows = claim(conn)
            times.append((time.perf_counter() - started) * 1000)
            ids = [row.id for row in rows]
            t = outbox_message
            conn.execute(update(t).where(t.c.id.in_(ids)).values(status=SENT, sent_at=db_now()))
    return statistics.median(times), min(times)


def pages_read(engine: Engine, claim: Claim) -> int:
    """Buffers (found in shared buffers or read) that a batch's locking statements touch,
    from their executed plans: each runs once under EXPLAIN (ANALYZE, BUFFERS) before it
    runs, in a transaction rolled back. Unlike a time, the machine's load leaves it be."""
    pages = 0

    def explain(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        nonlocal pages
        if "FOR UPDATE" in statement:
            cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}", parameters)
            top = cursor.fetchone()[0][0]["Plan"]
            pages += top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)

    with engine.connect() as conn:
        event.listen(conn, "before_cursor_execute", explain)
        try:
            with conn.begin() as transaction:
                claim(conn)
                transaction.rollback()
        finally:
            event.remove(conn, "before_cursor_execute", explain)
    return pages


def measured(rows: int, batches: int) -> dict[str, tuple[float, float, int]]:
    """Per claim: the median and least ms of ``batches`` batches, then a batch's pages."""
    with bench_schema() as db:
        migrate.upgrade(db)
        engine = create_engine(db, poolclass=NullPool)
        try:
            seed(engine, rows)
            return {
                name: (*batch_ms(engine, claim, batches), pages_read(engine, claim))
                for name, claim in claims().items()
            }
        finally:
            engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description="claim time against backlog size")
    parser.add_argument("--sizes", default="20000,200000", help="comma-separated row counts")
    parser.add_argument("--batches", type=int, default=8, help="batches of each claim")
    args = parser.parse_args()
    sizes = sorted(int(size) for size in args.sizes.split(","))
    most = int(sizes[0] * 0.8) // (len(claims()) * LIMIT)
    if args.batches > most:
        # Every batch of every claim must come back full at every size (the claims share
        # the unordered rows): an empty one at the end of a small backlog costs nothing.
        parser.error(f"--batches: at most {most} for {sizes[0]:,} rows")
    results = [measured(rows, args.batches) for rows in sizes]
    small, large = f"{sizes[0]:,}", f"{sizes[-1]:,}"
    columns = [f"{size} {what}" for what in ("median", "least", "pages") for size in (small, large)]
    table: list[tuple[str, ...]] = [("claim", *columns, "x: median / least / pages")]
    for name in results[0]:
        first, last = results[0][name], results[-1][name]
        cells = [name]
        for i, form in ((0, "{:.2f}"), (1, "{:.2f}"), (2, "{:,}")):
            cells += [form.format(first[i]), form.format(last[i])]
        cells += [" / ".join(f"{last[i] / first[i]:.2f}" if first[i] else "-" for i in range(3))]
        table.append(tuple(cells))
    print_rows(
        f"claims: ms per batch of {LIMIT} ({args.batches} batches each, claimed, marked sent "
        f"and committed) and the pages one batch touches, PostgreSQL, {os.cpu_count()} CPUs; "
        "target: x <= 1.25 (0.8x the rate)",
        table,
    )


if __name__ == "__main__":
    main()
