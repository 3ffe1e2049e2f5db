"""Fast-path benchmark: PostgreSQL + nats-server on loopback, figures as a table.

Run with `make bench` (or `python -m bench.fast_path --seconds 10`). Every figure
is measured in this run; ratios compare against a baseline taken in the same run.
  1. raw JetStream publish latency at each offered rate (the floor for the relay);
  2. commit->ack latency of the outbox at the same rate, timed from COMMIT's return,
     and the relay's CPU per message (CPU time of its threads, not wall time);
  3. app transactions/s with send() divided by the same transactions without it, and
     app-thread CPU (time.thread_time) per transaction with and without send();
  4. relay DB statements and CPU per delivered message at saturation.
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
from typing import Any

import nats
from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    update,
)
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


def throughput(work: Callable[[int], None], threads: int, seconds: float) -> tuple[float, float]:
    """Transactions/s reached by ``threads`` threads, and app-thread CPU seconds per transaction."""
    done = [0] * threads
    cpu = [0.0] * threads
    stop = time.monotonic() + seconds

    def run(k: int) -> None:
        n = 0
        started = time.thread_time()
        while time.monotonic() < stop:
            work(k * 10_000_000 + n)
            n += 1
        cpu[k] = time.thread_time() - started
        done[k] = n

    pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return sum(done) / seconds, sum(cpu) / max(1, sum(done))


def settle(ob: Outbox, expected: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while ob.stats is not None and ob.stats.marked < expected and time.monotonic() < deadline:
        time.sleep(0.01)


def relay_threads() -> list[threading.Thread]:
    """The relay's threads in this process: its loop and its DB executors."""
    return [t for t in threading.enumerate() if t.name.startswith("outbox-")]


def thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds ``thread`` has used so far (0 once it has ended)."""
    try:
        assert thread.ident is not None
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AssertionError, OSError, ProcessLookupError):
        return 0.0


class RelayCpu:
    """CPU time of the relay's threads between ``start`` and ``stop`` (threads met on the way
    are counted from zero: the executors start their thread on first use)."""

    def __init__(self) -> None:
        self._first: dict[int, float] = {}

    def start(self) -> None:
        self._first = {id(t): thread_cpu(t) for t in relay_threads()}

    def stop(self) -> tuple[float, float]:
        """(CPU seconds of the loop thread, of the DB threads)."""
        used = {t.name: thread_cpu(t) - self._first.get(id(t), 0.0) for t in relay_threads()}
        loop = sum(v for name, v in used.items() if name == "outbox-relay")
        return loop, sum(used.values()) - loop


def cpu_cell(cpu: tuple[float, float], messages: int) -> str:
    """Relay CPU microseconds per message: all threads (loop + DB threads)."""
    loop, db = (v / max(1, messages) * 1e6 for v in cpu)
    return f"{loop + db:.0f} ({loop:.0f} + {db:.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description="fast-path benchmark")
    parser.add_argument(
        "--rates", default="200,1000", help="offered msg/s, comma-separated (default 200,1000)"
    )
    parser.add_argument("--seconds", type=float, default=10, help="length of each phase")
    parser.add_argument("--threads", type=int, default=4, help="app threads")
    parser.add_argument(
        "--no-verify", action="store_true", help="verify_commit=False: no re-read before publishing"
    )
    parser.add_argument(
        "--per-tx", type=int, default=1, help="messages per transaction (latency phase)"
    )
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    rows: list[tuple[str, str, str]] = []
    with NatsServer() as server, bench_schema() as db:
        migrate.upgrade(db)
        engine = create_engine(db, pool_size=args.threads + 2)
        business.create_all(engine)
        with engine.begin() as conn:
            conn.execute(stock.insert(), [{"sku": f"SKU-{i:03d}", "qty": 0} for i in range(100)])
        options: dict[str, Any] = {"verify_commit": not args.no_verify, "sweeper": False}
        url = f"{server.url}?stream=BENCH&subjects=bench.>"
        for rate in rates:
            rows += latency_rows(engine, url, server.url, rate, args, options)
        ob = Outbox(engine, broker=url, **options)
        rows += app_rows(ob, args)
        burst = Outbox(engine, broker=url, **options)
        burst.start()
        cpu = RelayCpu()
        cpu.start()
        saturate(burst, args)
        relay_s = cpu.stop()
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
            (
                "saturation: relay CPU us/message",
                cpu_cell(relay_s, s.marked),
                "(loop + DB threads)",
            ),
        ]
        burst.stop()
        engine.dispose()
    print_table(rows, args)


def latency_rows(
    engine: Engine,
    url: str,
    nats_url: str,
    rate: float,
    args: argparse.Namespace,
    options: dict[str, Any],
) -> list[tuple[str, str, str]]:
    """Raw publishes, then the outbox, both paced at ``rate``: latency and relay CPU."""
    raw = raw_publish_latencies(nats_url, rate, args.seconds)
    ob = Outbox(engine, broker=url, **options)
    ob.start()
    cpu = RelayCpu()
    cpu.start()
    tx_rate = rate / args.per_tx
    reached = args.per_tx * paced(
        args.threads, tx_rate, args.seconds, receive(ob, with_send=True, per_tx=args.per_tx)
    )
    settle(ob, int(rate * args.seconds))
    relay_s = cpu.stop()
    stats = ob.stats
    assert stats is not None
    ob.stop()
    lat = list(stats.latencies)
    first_ratio = stats.first_attempt / max(1, stats.published)
    p99, raw_p99 = pct(lat, 99), pct(raw, 99)
    at = f"@{rate:.0f}/s"
    return [
        (f"{at} offered / reached msg/s", f"{rate:.0f} / {reached:.0f}", ""),
        (
            f"{at} raw JetStream publish p50 / p99 ms",
            f"{pct(raw, 50):.2f} / {raw_p99:.2f}",
            "baseline",
        ),
        (
            f"{at} commit->ack p50 / p99 ms",
            f"{pct(lat, 50):.2f} / {p99:.2f}",
            "from COMMIT's return",
        ),
        (
            f"{at} commit->ack p99 / raw p99",
            f"{p99 / raw_p99:.1f}x",
            verdict(p99 <= 2 * raw_p99, "<= 2x"),
        ),
        (
            f"{at} delivered on the first attempt",
            f"{first_ratio:.4%}",
            verdict(first_ratio >= 0.999, ">= 99.9%"),
        ),
        (
            f"{at} relay CPU us/message",
            cpu_cell(relay_s, stats.marked),
            "(loop + DB threads)",
        ),
    ]


def app_rows(ob: Outbox, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """App transactions/s and app-thread CPU per transaction, without send and with it."""
    base, base_cpu = throughput(receive(ob, with_send=False), args.threads, args.seconds)
    ob.start()
    with_send, send_cpu = throughput(receive(ob, with_send=True), args.threads, args.seconds)
    ob.stop()
    return [
        (
            f"app tx/s at {args.threads} threads without / with send",
            f"{base:.0f} / {with_send:.0f}",
            "",
        ),
        (
            "throughput ratio",
            f"{with_send / base:.2f}x",
            verdict(with_send / base >= 0.85, ">= 0.85x"),
        ),
        (
            "app-thread CPU us/tx without / with send",
            f"{base_cpu * 1e6:.0f} / {send_cpu * 1e6:.0f}",
            "",
        ),
        (
            "app-thread CPU us per send()+commit hand-off",
            f"{(send_cpu - base_cpu) * 1e6:.0f}",
            "the difference",
        ),
    ]


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
