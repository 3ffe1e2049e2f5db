"""The dashboard's pages over a big table: 100,000 dead rows (and pending and sent ones).

Run with `python -m bench.dashboard [--dead 100000] [--requests 50]` (PostgreSQL). A
scratch schema is filled by INSERT ... SELECT generate_series, then each page is asked
``--requests`` times through FastAPI's TestClient (the whole app: routing, queries,
templates) and its p50/p99 printed beside baselines measured in the same run: a
``SELECT 1`` round trip and the query of `outbox dead` (a page of 50, newest first).
The target is every page under 200 ms.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select, text

from bench.fast_path import bench_schema
from bench.report import print_rows
from outbox import migrate
from outbox.table import DEAD
from outbox.table import outbox_message as t
from relay import store
from relay.dashboard import create_app

FILL = """
INSERT INTO outbox_message (msg_id, topic, key, payload, status, attempts, last_error,
                            created_at, sent_at, seq)
SELECT gen_random_uuid(), 'bench.' || (i % 8), {key}, convert_to(repeat('x', 200), 'UTF8'),
       '{status}', {attempts}, {error}, now() - (({n} - i) * interval '30 ms'), {sent_at}, {seq}
FROM generate_series(1, {n}) AS i
"""


def fill(db: str, dead: int, pending: int, sent: int, blocked: int) -> None:
    engine = create_engine(db)
    with engine.begin() as conn:
        plain = {"key": "NULL", "seq": "NULL", "sent_at": "NULL"}
        fills = [
            {**plain, "n": dead, "status": "dead", "attempts": 5, "error": "'no: ' || i"},
            {**plain, "n": pending, "status": "pending", "attempts": 0, "error": "NULL"},
            {**plain, "n": sent, "status": "sent", "attempts": 1, "error": "NULL",
             "sent_at": "now() - (i % 3600) * interval '1 s'"},
            # keys with a dead head (seq 1) and a pending follower (seq 2)
            {"n": blocked, "status": "dead", "attempts": 5, "key": "'k' || i", "seq": "1",
             "error": "'boom'", "sent_at": "NULL"},
            {"n": blocked, "status": "pending", "attempts": 0, "key": "'k' || i", "seq": "2",
             "error": "NULL", "sent_at": "NULL"},
        ]  # fmt: skip
        for values in fills:
            conn.execute(text(FILL.format(**values)))
        conn.execute(text("ANALYZE outbox_message"))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dead", type=int, default=100_000)
    parser.add_argument("--pending", type=int, default=10_000)
    parser.add_argument("--sent", type=int, default=20_000)
    parser.add_argument("--blocked", type=int, default=500)
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()
    with bench_schema() as db:
        migrate.upgrade(db)
        started = time.perf_counter()
        fill(db, args.dead, args.pending, args.sent, args.blocked)
        filled_s = time.perf_counter() - started
        engine = create_engine(db)
        with engine.connect() as conn:
            dead = select(t.c.id).where(t.c.status == DEAD).order_by(t.c.id)
            ids = conn.execute(dead).scalars().all()
            deep_id = ids[len(ids) // 10]  # 90% of the way down, newest first
            deep = conn.execute(select(t.c.msg_id).where(t.c.id == deep_id)).scalar_one()

            def select_one() -> None:
                conn.execute(text("SELECT 1")).scalar_one()

            def dead_query() -> None:
                store.failures(conn, (DEAD,), None, 50, None)

            baselines = [
                ("SELECT 1 round trip (baseline)", timed(select_one, args.requests)),
                ("`outbox dead` query, 50 rows (baseline)", timed(dead_query, args.requests)),
            ]
        pages = {
            "overview /": "/",
            "/api/overview": "/api/overview",
            "dead letters, page 1 (50)": "/dead",
            "dead letters, a deep page (90% down)": f"/dead?before={deep}",
            "blocked keys": "/blocked",
            "one message": f"/messages/{deep}",
        }
        results = []
        with TestClient(create_app(engine)) as client:
            for name, path in pages.items():

                def get(path: str = path) -> None:
                    assert client.get(path).status_code == 200

                results.append((name, timed(get, args.requests)))
        engine.dispose()
    rows_out = [["", "p50 ms", "p99 ms"]]
    rows_out += [[name, f"{p50:.1f}", f"{p99:.1f}"] for name, (p50, p99) in [*baselines, *results]]
    total = args.dead + args.pending + args.sent + 2 * args.blocked
    print_rows(
        f"dashboard pages, {args.requests} requests each, {total:,} rows "
        f"({args.dead + args.blocked:,} dead; filled in {filled_s:.1f} s)",
        rows_out,
    )


if __name__ == "__main__":
    main()
