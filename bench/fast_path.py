"""Fast-path benchmark: PostgreSQL + nats-server on loopback, figures as a table.

Run with `make bench` (or `python -m bench.fast_path --seconds 10`). Every figure
is measured in this run; ratios compare against a baseline taken in the same run.
  1. raw JetStream publish latency at the offered rate (the floor for the relay);
  2. commit->ack latency of the outbox at the same offered rate;
  3. app transactions/s with send() divided by the same transactions without it;
  4. relay DB statements per delivered message at saturation.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager

import nats
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, update
from sqlalchemy.orm import Session

from bench.report import print_rows
from outbox import Outbox, migrate
from relay.testing import scratch_schema
from relay.testing.embedded import NatsServer

PG = os.environ.get("OUTBOX_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

business = MetaData()
receipts = Table(
    "bench_receipt", business, Column("id", Integer, primary_key=True), Column("sku", String(40))
)
stock = Table(
    "bench_stock", business, Column("sku", String(40), primary_key=True), Column("qty", Integer)
)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return (
        ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] * 1000
        if ordered
        else float("nan")
    )


def bench_schema() -> AbstractContextManager[str]:
    return scratch_schema(PG, "bench")


def paced(threads: int, rate: float, seconds: float, work: Callable[[int], None]) -> float:
    """Call ``work`` ``rate`` times a second from ``threads`` threads; returns the rate reached."""
    per_thread = rate / threads
    count = int(per_thread * seconds)

    def run(k: int) -> None:
        due = time.monotonic()
        for i in range(count):
            due += 1 / per_thread
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            work(k * count + i)

    started = time.monotonic()
    pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return threads * count / (time.monotonic() - started)


def raw_publish_latencies(url: str, rate: float, seconds: float) -> list[float]:
    """JetStream publishes paced at ``rate``, each timed from call to ack."""

    async def main() -> list[float]:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(name="RAW", subjects=["raw.>"])
        latencies: list[float] = []

        async def one(i: int) -> None:
            started = time.perf_counter()
            await js.publish("raw.x", b"x" * 100, headers={"Nats-Msg-Id": str(uuid.uuid4())})
            latencies.append(time.perf_counter() - started)

        tasks = []
        due = time.monotonic()
        for i in range(int(rate * seconds)):
            due += 1 / rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        await nc.close()
        return latencies

    return asyncio.run(main())


def receive(ob: Outbox, with_send: bool, per_tx: int = 1) -> Callable[[int], None]:
    """The warehouse-inbound transaction: a receipt row and a stock update (and the messages)."""

    def work(n: int) -> None:
        sku = f"SKU-{n % 100:03d}"
        with Session(ob.engine) as session, session.begin():
            session.execute(receipts.insert().values(sku=sku))
            session.execute(update(stock).where(stock.c.sku == sku).values(qty=stock.c.qty + 1))
            for line in range(per_tx if with_send else 0):
                ob.send(session, "bench.inbound", {"sku": sku, "n": n, "line": line}, key=sku)

    return work


def throughput(work: Callable[[int], None], threads: int, seconds: float) -> float:
    done = [0] * threads
    stop = time.monotonic() + seconds

    def run(k: int) -> None:
        n = 0
        while time.monotonic() < stop:
            work(k * 10_000_000 + n)
            n += 1
        done[k] = n

    pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return sum(done) / seconds


def settle(ob: Outbox, expected: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while ob.stats is not None and ob.stats.marked < expected and time.monotonic() < deadline:
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description="fast-path benchmark")
    parser.add_argument("--rate", type=float, default=1000, help="offered msg/s (default 1000)")
    parser.add_argument("--seconds", type=float, default=10, help="length of each phase")
    parser.add_argument("--threads", type=int, default=4, help="app threads")
    parser.add_argument(
        "--no-verify", action="store_true", help="verify_commit=False: no re-read before publishing"
    )
    parser.add_argument(
        "--per-tx", type=int, default=1, help="messages per transaction (latency phase)"
    )
    args = parser.parse_args()
    rows: list[tuple[str, str, str]] = []
    with NatsServer() as server, bench_schema() as db:
        raw = raw_publish_latencies(server.url, args.rate, args.seconds)
        migrate.upgrade(db)
        engine = create_engine(db, pool_size=args.threads + 2)
        business.create_all(engine)
        with engine.begin() as conn:
            conn.execute(stock.insert(), [{"sku": f"SKU-{i:03d}", "qty": 0} for i in range(100)])
        options = {"verify_commit": not args.no_verify, "sweeper": False}
        ob = Outbox(engine, broker=f"{server.url}?stream=BENCH&subjects=bench.>", **options)
        ob.start()
        tx_rate = args.rate / args.per_tx
        reached = args.per_tx * paced(
            args.threads, tx_rate, args.seconds, receive(ob, with_send=True, per_tx=args.per_tx)
        )
        settle(ob, int(args.rate * args.seconds))
        stats = ob.stats
        assert stats is not None
        lat = list(stats.latencies)
        first_ratio = stats.first_attempt / max(1, stats.published)
        p99, raw_p99 = pct(lat, 99), pct(raw, 99)
        rows += [
            ("offered / reached msg/s", f"{args.rate:.0f} / {reached:.0f}", ""),
            (
                "raw JetStream publish p50 / p99 ms",
                f"{pct(raw, 50):.2f} / {raw_p99:.2f}",
                "baseline",
            ),
            ("commit->ack p50 / p95 ms", f"{pct(lat, 50):.2f} / {pct(lat, 95):.2f}", ""),
            ("commit->ack p99 ms", f"{p99:.2f}", verdict(p99 <= 20, "<= 20")),
            (
                "commit->ack p99 / raw p99",
                f"{p99 / raw_p99:.1f}x",
                verdict(p99 <= 3 * raw_p99, "<= 3x"),
            ),
            (
                "delivered on the first attempt",
                f"{first_ratio:.4%}",
                verdict(first_ratio >= 0.999, ">= 99.9%"),
            ),
        ]
        ob.stop()
        base = throughput(receive(ob, with_send=False), args.threads, args.seconds)
        ob.start()
        with_send = throughput(receive(ob, with_send=True), args.threads, args.seconds)
        rows += [
            ("app tx/s without send / with send", f"{base:.0f} / {with_send:.0f}", ""),
            (
                "throughput ratio",
                f"{with_send / base:.2f}x",
                verdict(with_send / base >= 0.85, ">= 0.85x"),
            ),
        ]
        ob.stop()
        burst = Outbox(engine, broker=f"{server.url}?stream=BENCH&subjects=bench.>", **options)
        burst.start()
        saturate(burst, args)
        s = burst.stats
        assert s is not None
        per_msg = s.mark_statements / max(1, s.marked)
        rows += [
            (
                "saturation: messages marked",
                f"{s.marked}",
                f"{s.marked / max(1, s.mark_statements):.0f} per batch",
            ),
            ("relay statements per message", f"{per_msg:.3f}", verdict(per_msg <= 0.05, "<= 0.05")),
        ]
        burst.stop()
        engine.dispose()
    print_table(rows, args)


def saturate(ob: Outbox, args: argparse.Namespace) -> None:
    """Commit as fast as the app threads can, several messages per transaction."""
    count = [0]
    lock = threading.Lock()

    def work(n: int) -> None:
        with Session(ob.engine) as session, session.begin():
            for i in range(20):
                ob.send(session, "bench.inbound", {"n": n, "i": i})
        with lock:
            count[0] += 20

    throughput(work, args.threads, args.seconds)
    settle(ob, count[0])


def verdict(ok: bool, target: str) -> str:
    return f"{'met' if ok else 'NOT met'} ({target})"


def print_table(rows: list[tuple[str, str, str]], args: argparse.Namespace) -> None:
    verify = "off" if args.no_verify else "on"
    title = f"fast path: {args.threads} app threads, {args.per_tx} message(s) per transaction, "
    title += f"verify_commit {verify}, {args.seconds:.0f} s per phase, "
    title += f"{os.cpu_count()} CPUs shared by app, PostgreSQL and NATS"
    print_rows(title, rows)


if __name__ == "__main__":
    main()
