"""The dashboard's pages over a big table: a retained ledger of 2,000,000 sent rows over a
week (a few thousand in the last hour) with a burst of 100,000 dead ones among them, and
newer pending rows and blocked keys.

Run with `python -m bench.dashboard [--sent 2000000] [--dead 100000] [--requests 50]
[--revision 0005]` (PostgreSQL; --revision: time a schema before the dashboard's indexes).
A scratch schema is filled by INSERT ... SELECT generate_series, then each page is asked
``--requests`` times through FastAPI's TestClient (the whole app: routing, queries,
templates) and its p50/p99 printed beside baselines measured in the same run: a
``SELECT 1`` round trip and the query of `outbox dead` (a page of 50, newest first).
The overview is timed with its queries run for every request, then as served (its
figures shared by all the pages polling for 2 s). The target is every page under 200 ms."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select, text

from bench.fast_path import bench_schema
from bench.report import print_rows
from outbox import migrate
from outbox.table import DEAD
from outbox.table import outbox_message as t
from relay import store
from relay.dashboard import create_app

# The retained ledger, oldest row first (row ids follow time, as sends do): sent rows over
# LEDGER_DAYS (all but the newest hour's before /overview's window), with a burst of dead
# rows (an outage) a third of the way along: the newer sent rows lie between them and the
# table's end, where `ORDER BY id DESC` starts.
LEDGER = """
INSERT INTO outbox_message (msg_id, topic, payload, status, attempts, last_error,
                            created_at, sent_at)
SELECT gen_random_uuid(), 'bench.' || (i % 8), convert_to(repeat('x', 200), 'UTF8'),
       CASE WHEN dead THEN 'dead' ELSE 'sent' END, CASE WHEN dead THEN 5 ELSE 1 END,
       CASE WHEN dead THEN 'no: ' || i END,
       at - interval '12 ms', CASE WHEN dead THEN NULL ELSE at END
FROM generate_series(1, {n}) AS i,
     LATERAL (SELECT i BETWEEN {burst} AND {burst} + {dead} - 1 AS dead,
                     now() - ({n} - i) * ({span_s}::float / {n}) * interval '1 s' AS at) AS x
"""
# The newest rows: pending ones, and keys of one ordered topic with a dead head (seq 1)
# and a pending follower: bench.3's dead rows are only the burst's.
NEWEST = """
INSERT INTO outbox_message (msg_id, topic, key, seq, payload, status, attempts, last_error,
                            created_at)
SELECT gen_random_uuid(), {topic}, {key}, {seq}, convert_to(repeat('x', 200), 'UTF8'),
       '{status}', {attempts}, {error}, now() - (({n} - i) * interval '30 ms')
FROM generate_series(1, {n}) AS i
"""
LEDGER_DAYS = 7


def fill(db: str, dead: int, pending: int, sent: int, blocked: int) -> None:
    engine = create_engine(db)
    with engine.begin() as conn:
        n = sent + dead
        span_s = LEDGER_DAYS * 86400
        conn.execute(text(LEDGER.format(n=n, dead=dead, burst=n // 3, span_s=span_s)))
        newest = [
            {"n": pending, "status": "pending", "attempts": 0, "key": "NULL", "seq": "NULL",
             "error": "NULL", "topic": "'bench.' || (i % 8)"},
            {"n": blocked, "status": "dead", "attempts": 5, "key": "'k' || i", "seq": "1",
             "error": "'boom'", "topic": "'bench.ordered'"},
            {"n": blocked, "status": "pending", "attempts": 0, "key": "'k' || i", "seq": "2",
             "error": "NULL", "topic": "'bench.ordered'"},
        ]  # fmt: skip
        for values in newest:
            conn.execute(text(NEWEST.format(**values)))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE outbox_message"))  # as autovacuum would have
    engine.dispose()


def timed(call: Callable[[], object], n: int) -> tuple[float, float]:
    """p50 and p99 of ``n`` calls, in ms (after one warm-up call)."""
    call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return times[len(times) // 2], times[min(n - 1, int(n * 0.99))]


def timed_pages(
    app: FastAPI, pages: dict[str, str], n: int
) -> list[tuple[str, tuple[float, float]]]:
    results = []
    with TestClient(app, base_url="http://127.0.0.1") as client:
        for name, path in pages.items():

            def get(path: str = path) -> None:
                status = client.get(path).status_code
                if status != 200:  # not an assert: `python -O` would time error pages
                    raise SystemExit(f"{path}: HTTP {status}")

            results.append((name, timed(get, n)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dead", type=int, default=100_000)
    parser.add_argument("--pending", type=int, default=10_000)
    parser.add_argument("--sent", type=int, default=2_000_000)
    parser.add_argument("--blocked", type=int, default=500)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument(
        "--revision",
        help="the schema's revision to time, e.g. 0005: before the dashboard's indexes (0006)",
    )
    args = parser.parse_args()
    with bench_schema() as db:
        migrate.upgrade(db, args.revision or "head")
        started = time.perf_counter()
        fill(db, args.dead, args.pending, args.sent, args.blocked)
        filled_s = time.perf_counter() - started
        engine = create_engine(db)
        with engine.connect() as conn:
            dead = select(t.c.msg_id).where(t.c.status == DEAD).order_by(t.c.id)
            # 90% of the way down, newest first
            deep = conn.execute(dead.offset(args.dead // 10).limit(1)).scalar_one()

            def select_one() -> None:
                conn.execute(text("SELECT 1")).scalar_one()

            def dead_query() -> None:
                store.failures(conn, (DEAD,), None, 50, None)

            baselines = [
                ("SELECT 1 round trip (baseline)", timed(select_one, args.requests)),
                ("`outbox dead` query, 50 rows (baseline)", timed(dead_query, args.requests)),
            ]
        pages = {
            "overview / (its queries every time)": "/",
            "/api/overview (its queries every time)": "/api/overview",
            "dead letters, page 1 (50)": "/dead",
            "dead letters, a deep page (90% down)": f"/dead?before={deep}",
            "dead letters of one topic (older), page 1": "/dead?topic=bench.3",
            "blocked keys": "/blocked",
            "one message": f"/messages/{deep}",
        }
        results = timed_pages(create_app(engine, overview_cache_s=0), pages, args.requests)
        shared = {"/api/overview (shared 2 s cache, as served)": "/api/overview"}
        results += timed_pages(create_app(engine), shared, args.requests)
        engine.dispose()
    rows_out = [["", "p50 ms", "p99 ms"]]
    rows_out += [[name, f"{p50:.1f}", f"{p99:.1f}"] for name, (p50, p99) in [*baselines, *results]]
    total = args.dead + args.pending + args.sent + 2 * args.blocked
    print_rows(
        f"dashboard pages, schema {args.revision or 'at head'}, {args.requests} requests each, "
        f"{total:,} rows "
        f"({args.dead + args.blocked:,} dead; filled in {filled_s:.1f} s)",
        rows_out,
    )


if __name__ == "__main__":
    main()
