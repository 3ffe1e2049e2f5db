"""Sweeper benchmark: drain a backlog of pending rows with 1 and 2 `outbox drain` processes.

Run with `make bench` (or `python -m bench.sweeper --rows 100000`). A JetStream consumer
runs in its own process throughout, pulling and acknowledging every message (issue #17's
condition). Baseline in the same run: the same number of messages published by one
pipelined JetStream publisher (plain nats-py ``js.publish``, 500 in flight at a time), with
no database involved; next to it, the relay's NATS adapter publishing the same way.
Figures: msg/s over the whole process (start-up included) and as the drain itself counts
it (steady), and CPU per message (the publisher's, or the drain
processes' user+system time; the database and nats-server are not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.errors import TimeoutError as NatsTimeout
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

import outbox.rows
from bench.fast_path import bench_schema
from bench.report import print_rows
from outbox import migrate
from outbox.message import Message, build_message
from relay import store
from relay.brokers.nats import NatsBroker, create_stream, sent_headers
from relay.testing.embedded import NatsServer

OUTBOX = str(Path(sys.executable).with_name("outbox"))
STREAM, SUBJECTS = "SWEEP", "sweep.>"


@dataclass
class Rate:
    wall: float  # msg/s over the whole run, start-up included
    steady: float  # msg/s as the drain counts it (publishing only); = wall for raw
    cpu_us: float  # CPU microseconds per message, in the measured processes


def seed(db: str, rows: int, topic: str) -> set[str]:
    """Pending rows older than the sweeper age, written in bulk; their msg_ids."""
    ids: set[str] = set()
    engine = create_engine(db, poolclass=NullPool)
    with engine.begin() as conn:
        for start in range(0, rows, 5000):
            batch = [
                build_message(topic, {"n": n}, max_payload_bytes=1000)
                for n in range(start, min(rows, start + 5000))
            ]
            outbox.rows.write(conn, batch)
            ids.update(m.msg_id for m in batch)
        conn.execute(
            text("UPDATE outbox_message SET created_at = created_at - interval '1 minute'")
        )
    engine.dispose()
    return ids


def pending(db: str) -> int:
    engine = create_engine(db, poolclass=NullPool)
    with engine.connect() as conn:
        n = store.pending_count(conn)
    engine.dispose()
    return n


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def drain_with_workers(db: str, broker: str, workers: int, concurrency: int) -> Rate:
    """Run `workers` drain processes at once."""
    rows = pending(db)
    cpu = children_cpu()
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [OUTBOX, "drain", "--db", db, "--broker", broker, "--concurrency", str(concurrency)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(workers)
    ]
    outputs = [p.communicate()[0] for p in procs]
    elapsed = time.monotonic() - started
    cpu = children_cpu() - cpu
    left = pending(db)
    if left or any(p.returncode for p in procs):
        codes = [p.returncode for p in procs]
        print(f"warning: {left} rows left pending, exit codes {codes}", file=sys.stderr)
    done = rows - left
    # The drains overlap: the slowest one's own time is the steady span of the whole.
    spans = [float(m.group(1)) for out in outputs if (m := re.search(r" in ([\d.]+) s", out))]
    steady = done / max(spans) if spans else 0.0
    return Rate(done / elapsed, steady, cpu / max(done, 1) * 1e6)


def raw_publish_rate(url: str, rows: int, topic: str) -> Rate:
    """The baseline: plain nats-py ``js.publish``, 500 in flight at a time (no adapter)."""

    async def main() -> Rate:
        nc = await nats.connect(url, name="bench-raw")
        js = nc.jetstream(timeout=5)
        messages = [build_message(topic, {"n": n}, max_payload_bytes=1000) for n in range(rows)]

        async def batch(chunk: list[Message]) -> None:
            await asyncio.gather(
                *(js.publish(m.topic, m.payload, headers=sent_headers(m)) for m in chunk)
            )

        rate = await timed(rows, messages, batch)
        await nc.close()
        return rate

    return asyncio.run(main())


def adapter_publish_rate(url: str, rows: int, topic: str) -> Rate:
    """The relay's NATS adapter alone, 500 messages per ``publish`` call (no database)."""

    async def main() -> Rate:
        broker = NatsBroker(url)
        await broker.connect()
        messages = [build_message(topic, {"n": n}, max_payload_bytes=1000) for n in range(rows)]

        async def batch(chunk: list[Message]) -> None:
            results = await broker.publish(chunk)
            assert all(r.ok for r in results), [r.error for r in results if not r.ok][:1]

        rate = await timed(rows, messages, batch)
        await broker.close()
        return rate

    return asyncio.run(main())


async def timed(
    rows: int, messages: list[Message], batch: Callable[[list[Message]], Awaitable[None]]
) -> Rate:
    """Publish ``messages`` 500 at a time with ``batch``: msg/s and CPU per message."""
    cpu = time.process_time()
    started = time.monotonic()
    for start in range(0, rows, 500):
        await batch(messages[start : start + 500])
    elapsed = time.monotonic() - started
    cpu = time.process_time() - cpu
    return Rate(rows / elapsed, rows / elapsed, cpu / rows * 1e6)


def consume(url: str) -> None:
    """The consumer process: pull and acknowledge everything on the stream until SIGTERM."""

    async def main() -> int:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        nc = await nats.connect(url, name="bench-consumer")
        sub = await nc.jetstream().pull_subscribe(SUBJECTS, durable="bench", stream=STREAM)
        count = 0
        while not stop.is_set():
            try:
                batch = await sub.fetch(500, timeout=0.5)
            except (NatsTimeout, TimeoutError):
                continue
            for msg in batch:
                await msg.ack()
            count += len(batch)
        await nc.close()
        return count

    print(f"consumed {asyncio.run(main())}", flush=True)


def start_consumer(url: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.sweeper", "--consume", url], stdout=subprocess.PIPE, text=True
    )
    return proc


def stop_consumer(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0]
    return out.strip().rpartition(" ")[2] or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description="sweeper benchmark")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=2, help="sweeps per worker process")
    parser.add_argument("--consume", metavar="URL", help=argparse.SUPPRESS)  # the consumer
    args = parser.parse_args()
    if args.consume:
        consume(args.consume)
        return
    table: list[tuple[str, ...]] = [("", "msg/s", "steady msg/s", "x raw", "CPU us/msg")]
    with NatsServer() as server:
        create_stream(server.url, STREAM, SUBJECTS)
        consumer = start_consumer(server.url)
        url = f"{server.url}?stream={STREAM}&subjects={SUBJECTS}&timeout=5"
        try:
            for workers in (1, 2):  # a baseline next to each drain: the load drifts
                raw = raw_publish_rate(server.url, args.rows, f"sweep.raw{workers}")
                table.append(row("raw pipelined JetStream publish (nats-py js.publish)", raw, raw))
                adapter = adapter_publish_rate(url, args.rows, f"sweep.adapter{workers}")
                table.append(row("the NATS adapter's publish, no database", adapter, raw))
                with bench_schema() as db:
                    migrate.upgrade(db)
                    seed(db, args.rows, f"sweep.w{workers}")
                    rate = drain_with_workers(db, url, workers, args.concurrency)
                table.append(row(f"outbox drain, {workers} process(es)", rate, raw))
        finally:
            consumed = stop_consumer(consumer)
    print_rows(
        f"sweeper: {args.rows:,} pending rows, PostgreSQL + nats-server + a consumer process "
        f"(consumed {consumed}), {os.cpu_count()} CPUs; targets: drain >= 10,000 msg/s and "
        ">= 0.5x raw",
        table,
    )


def row(name: str, rate: Rate, raw: Rate) -> tuple[str, ...]:
    return (
        name,
        f"{rate.wall:,.0f}",
        f"{rate.steady:,.0f}",
        f"{rate.steady / raw.steady:.2f}x",
        f"{rate.cpu_us:.0f}",
    )


if __name__ == "__main__":
    main()
