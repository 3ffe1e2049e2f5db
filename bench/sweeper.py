"""Sweeper benchmark: drain a backlog of pending rows with 1 and 2 worker processes.

Run with `make bench` (or `python -m bench.sweeper --rows 100000`). Baseline in the
same run: the same messages published by one pipelined JetStream publisher (the
adapter's own batch publish, 500 at a time), with no database involved.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import create_engine, insert, text
from sqlalchemy.pool import NullPool

from bench.fast_path import bench_schema
from bench.report import print_rows
from outbox import migrate, outbox_message
from outbox.message import build_message
from relay import store
from relay.brokers.nats import NatsBroker
from relay.testing.embedded import NatsServer

OUTBOX = str(Path(sys.executable).with_name("outbox"))


def seed(db: str, rows: int, topic: str) -> None:
    """Pending rows older than the sweeper age, written in bulk."""
    engine = create_engine(db, poolclass=NullPool)
    with engine.begin() as conn:
        for start in range(0, rows, 5000):
            batch = [
                build_message(topic, {"n": n}, max_payload_bytes=1000)
                for n in range(start, min(rows, start + 5000))
            ]
            conn.execute(
                insert(outbox_message),
                [
                    {
                        "msg_id": m.msg_id,
                        "topic": m.topic,
                        "payload": m.payload,
                        "headers": m.headers,
                    }
                    for m in batch
                ],
            )
        conn.execute(
            text("UPDATE outbox_message SET created_at = created_at - interval '1 minute'")
        )
    engine.dispose()


def pending(db: str) -> int:
    engine = create_engine(db, poolclass=NullPool)
    with engine.connect() as conn:
        n = store.pending_count(conn)
    engine.dispose()
    return n


def drain_with_workers(db: str, broker: str, workers: int, concurrency: int) -> float:
    """Run `workers` drain processes at once; return messages per second."""
    rows = pending(db)
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [OUTBOX, "drain", "--db", db, "--broker", broker, "--concurrency", str(concurrency)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(workers)
    ]
    codes = [p.wait() for p in procs]
    elapsed = time.monotonic() - started
    left = pending(db)
    if left or any(codes):
        print(f"warning: {left} rows left pending, exit codes {codes}", file=sys.stderr)
    return (rows - left) / elapsed


def raw_publish_rate(url: str, rows: int, topic: str) -> float:
    async def main() -> float:
        broker = NatsBroker(url)
        await broker.connect()
        messages = [build_message(topic, {"n": n}, max_payload_bytes=1000) for n in range(rows)]
        started = time.monotonic()
        for start in range(0, rows, 500):
            results = await broker.publish(messages[start : start + 500])
            assert all(r.ok for r in results), [r.error for r in results if not r.ok][:1]
        elapsed = time.monotonic() - started
        await broker.close()
        return rows / elapsed

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description="sweeper benchmark")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=2, help="sweeps per worker process")
    args = parser.parse_args()
    rows: list[tuple[str, str]] = []
    with NatsServer() as server:
        url = f"{server.url}?stream=SWEEP&subjects=sweep.>&timeout=5"
        raw = raw_publish_rate(url, args.rows, "sweep.raw")
        rows.append(("raw pipelined JetStream publish msg/s", f"{raw:,.0f}"))
        for workers in (1, 2):
            with bench_schema() as db:
                migrate.upgrade(db)
                seed(db, args.rows, f"sweep.w{workers}")
                rate = drain_with_workers(db, url, workers, args.concurrency)
            rows.append((f"drain, {workers} worker process(es) msg/s", f"{rate:,.0f}"))
            rows.append(("  ratio to raw publish (target >= 0.5x with 1)", f"{rate / raw:.2f}x"))
    print_rows(
        f"sweeper: {args.rows:,} pending rows, PostgreSQL + nats-server, {os.cpu_count()} CPUs",
        rows,
    )


if __name__ == "__main__":
    main()
