"""Backlog benchmark: `outbox drain` of N pending rows, for growing N (issue 40, item 5).

Run with `python -m bench.backlog` (20,000 and 200,000 rows) or `--sizes 20000,1000000`.
Each size: a fresh PostgreSQL schema, N pending rows written with one INSERT ... SELECT
(older than the sweeper age, a small JSON payload each), then one `outbox drain` process
into a local nats-server (JetStream, file storage). Figures: msg/s as the drain counts
it (steady) and over the whole process (start-up included), and each size's steady rate
as a ratio to the smallest size's in the same run: a drain whose batches each cost the
whole remaining backlog falls as N grows; target: >= 0.8x at 1M rows.
"""

from __future__ import annotations

import argparse
import os

from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from bench.fast_path import bench_schema
from bench.report import print_rows
from bench.sweeper import Rate, drain_with_workers
from outbox import migrate
from relay.brokers.nats import create_stream
from relay.testing.embedded import NatsServer

STREAM, SUBJECTS = "BACKLOG", "backlog.>"
SEED = """
    INSERT INTO outbox_message (msg_id, topic, payload, created_at)
    SELECT gen_random_uuid(), 'backlog.n', convert_to('{"n": ' || g || '}', 'UTF8'),
           now() - interval '1 minute'
    FROM generate_series(1, :rows) AS g"""


def seed(db: str, rows: int) -> None:
    """``rows`` pending rows, older than the sweeper age, in one statement; analyzed."""
    engine = create_engine(db, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text(SEED), {"rows": rows})
    with engine.connect() as conn:
        conn.execute(text("ANALYZE outbox_message"))
        conn.commit()
    engine.dispose()


def drained(broker: str, rows: int, concurrency: int) -> Rate:
    with bench_schema() as db:
        migrate.upgrade(db)
        seed(db, rows)
        return drain_with_workers(db, broker, 1, concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description="drain rate against backlog size")
    parser.add_argument("--sizes", default="20000,200000", help="comma-separated row counts")
    parser.add_argument("--concurrency", type=int, default=2, help="sweeps side by side")
    args = parser.parse_args()
    sizes = sorted(int(size) for size in args.sizes.split(","))
    table: list[tuple[str, ...]] = [("pending rows", "msg/s", "steady msg/s", "x smallest")]
    with NatsServer() as server:
        create_stream(server.url, STREAM, SUBJECTS)
        broker = f"{server.url}?stream={STREAM}&subjects={SUBJECTS}&timeout=5"
        rates = [drained(broker, rows, args.concurrency) for rows in sizes]
    for rows, rate in zip(sizes, rates, strict=True):
        ratio = rate.steady / rates[0].steady if rates[0].steady else 0.0
        table.append((f"{rows:,}", f"{rate.wall:,.0f}", f"{rate.steady:,.0f}", f"{ratio:.2f}x"))
    print_rows(
        f"backlog: `outbox drain` (concurrency {args.concurrency}) into nats-server, "
        f"PostgreSQL, {os.cpu_count()} CPUs; target: the largest >= 0.8x the smallest",
        table,
    )


if __name__ == "__main__":
    main()
