"""The consumer's inbox: throughput per broker and what the inbox row costs per message.

Run with `python -m bench.inbox [--messages 5000] [--runs 3] [--brokers nats,redis,rabbitmq]`
(PostgreSQL, the wheel's nats-server started here, Redis 127.0.0.1:6379, RabbitMQ
127.0.0.1:5672 guest/guest). Each broker gets ``--messages`` messages published once by
the relay's own adapter (relay.brokers.*: UUIDv7 msg_ids, the relay's headers and
fields), and every run reads all of them through a consumer name of its own (a durable
consumer, a consumer group, a queue declared before the publish). Two modes, the same
runner (relay.consume.runner.Consumer, batch 16) and subscription:

  alone  the handler's work by itself: the business INSERT, committed in a transaction of
         its own per message, acked after the commit; ``Inbox`` with its row left out;
  inbox  the same through ``Inbox``: the inbox row is the transaction's first statement.

Each run's window opens as its first delivery is taken in hand and closes as the last is
settled. Over it: msg/s; CPU per message of this process (time.process_time, its
threads) and of the PostgreSQL backends of its connections (/proc, a local server);
and the median message's time in hand (taken to settled: handling, commit, ack), which
a loaded machine's bursts disturb less than msg/s. The modes alternate (alone, inbox,
inbox, alone, ...) against the machine's drift; the tables give medians over
``--runs`` and the load average before and after. The inbox row's cost per message is
the difference of the modes' medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, NamedTuple

import aio_pika
import redis
from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    event,
    func,
    insert,
    select,
    text,
)
from sqlalchemy.orm import Session

from bench.fast_path import bench_schema
from bench.report import print_rows
from outbox import migrate
from outbox.broker import Broker
from outbox.consumer import InboxMessage, Outcome
from outbox.engines import engine_from
from outbox.inbox import Inbox
from outbox.message import Message, uuid7
from outbox.table import inbox_message
from relay.brokers.nats import NatsBroker
from relay.brokers.rabbitmq import RabbitBroker
from relay.brokers.redis import RedisBroker
from relay.consume.deliveries import Delivery, Subscription
from relay.consume.nats import NatsSubscription
from relay.consume.rabbitmq import RabbitSubscription
from relay.consume.redis import RedisSubscription
from relay.consume.runner import Consumer
from relay.testing.embedded import NatsServer

REDIS = "redis://127.0.0.1:6379/0"
RABBITMQ = "amqp://guest:guest@127.0.0.1:5672/"
TOPIC = "bench.order.created"
PATTERN = "bench.order.*"
STREAM = "BENCH_INBOX"
PUBLISH_BATCH = 500
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
WARM_UP = 500  # messages handled before the measured runs (pools, threads, code paths)
MODES = ("alone", "inbox")

business = MetaData()
orders = Table(
    "bench_inbox_order",
    business,
    Column("msg_id", String(36), primary_key=True),
    Column("amount", Integer, nullable=False),
)


class WithoutRow(Inbox):
    """The inbox's handling with its row left out: the same session, transaction,
    worker thread and outcome, minus the INSERT into outbox_inbox."""

    def _record(self, session: Session, message: InboxMessage) -> None:
        return None


def build(engine: Engine, consumer: str, mode: str) -> Inbox:
    inbox = (Inbox if mode == "inbox" else WithoutRow)(engine, consumer)

    @inbox.handler(PATTERN)
    def order(session: Session, message: InboxMessage) -> None:
        amount = json.loads(message.payload)["amount"]
        session.execute(insert(orders).values(msg_id=str(message.msg_id), amount=amount))

    return inbox


class Backends:
    """The PostgreSQL backends of an engine's connections (pg_backend_pid at connect) and
    their CPU seconds, read from /proc: the database's share of the work, which
    time.process_time does not see. None where /proc does not show them (a remote
    server)."""

    def __init__(self, engine: Engine) -> None:
        self.pids: set[int] = set()
        event.listen(engine, "connect", self.connected)

    def connected(self, dbapi_connection: Any, record: object) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("SELECT pg_backend_pid()")
        self.pids.add(int(cursor.fetchone()[0]))
        cursor.close()
        dbapi_connection.rollback()

    def cpu(self) -> float | None:
        total = 0.0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                return None
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        return total


class Timed(Consumer):
    """The runner's loop, stopped once ``n`` messages are handled; the window from the
    first delivery taken in hand to the n-th settled, in wall and CPU seconds (this
    process's, the database backends'), and each message's time in hand."""

    def __init__(self, inbox: Inbox, subscription: Subscription, n: int, db: Backends) -> None:
        super().__init__(inbox, subscription)
        self.n, self.db, self.stopping = n, db, asyncio.Event()
        self.started = self.cpu_started = self.wall = self.cpu = 0.0
        self.db_started: float | None = None
        self.db_cpu: float | None = None
        self.in_hand: list[float] = []

    async def one(self, delivery: Delivery) -> Outcome | None:
        if not self.started:
            self.db_started = self.db.cpu()
            self.started, self.cpu_started = time.perf_counter(), time.process_time()
        taken = time.perf_counter()
        outcome = await super().one(delivery)
        self.in_hand.append(time.perf_counter() - taken)
        if self.counts[Outcome.HANDLED] >= self.n and not self.stopping.is_set():
            self.wall = time.perf_counter() - self.started
            self.cpu = time.process_time() - self.cpu_started
            ended = self.db.cpu()
            if ended is not None and self.db_started is not None:
                self.db_cpu = ended - self.db_started
            self.stopping.set()
        return outcome


class Figures(NamedTuple):
    rate: float  # msg/s over the window
    cpu_us: float  # this process's CPU microseconds per message
    db_cpu_us: float  # the PostgreSQL backends' CPU microseconds per message (nan: unseen)
    in_hand_us: float  # the median message's time from taken in hand to settled


class Target(NamedTuple):
    """A broker with the bench's messages in it: the consumer URL and subscriptions."""

    name: str
    url: str
    subscribe: Callable[[str, str], Subscription]  # (url, consumer)


def consume(
    engine: Engine, db: Backends, target: Target, consumer: str, mode: str, n: int
) -> Figures:
    """One run: ``n`` messages handled by a fresh consumer; checks what it wrote."""
    inbox = build(engine, consumer, mode)
    timed = Timed(inbox, target.subscribe(target.url, consumer), n, db)
    deadline_s = 60.0 + n / 20  # 20 msg/s at the least, or the run is broken

    async def main() -> None:
        await asyncio.wait_for(timed.run(timed.stopping), deadline_s)

    asyncio.run(main())
    counted = dict(timed.counts)
    if counted.get(Outcome.HANDLED) != n or len(counted) != 1:
        raise RuntimeError(f"{target.name} {mode}: expected {n} handled, got {counted}")
    check_rows(engine, n if mode == "inbox" else 0, n)
    db_cpu_us = float("nan") if timed.db_cpu is None else timed.db_cpu / n * 1e6
    in_hand_us = statistics.median(timed.in_hand) * 1e6
    return Figures(n / timed.wall, timed.cpu / n * 1e6, db_cpu_us, in_hand_us)


def check_rows(engine: Engine, inbox_rows: int, order_rows: int) -> None:
    """The run wrote what it should; the tables are emptied for the next one."""
    with engine.begin() as conn:
        got = (
            conn.execute(select(func.count()).select_from(inbox_message)).scalar_one(),
            conn.execute(select(func.count()).select_from(orders)).scalar_one(),
        )
        conn.execute(text(f"TRUNCATE {inbox_message.name}, {orders.name}"))
    if got != (inbox_rows, order_rows):
        raise RuntimeError(f"rows (inbox, orders) {got}, expected {(inbox_rows, order_rows)}")


def messages(n: int) -> list[Message]:
    return [Message(str(uuid7()), TOPIC, json.dumps({"amount": i}).encode()) for i in range(n)]


async def publish(broker: Broker, sent: list[Message]) -> None:
    """Through the relay's adapter, in batches; every message stored."""
    await broker.connect()
    try:
        for start in range(0, len(sent), PUBLISH_BATCH):
            results = await broker.publish(sent[start : start + PUBLISH_BATCH])
            if failed := [r for r in results if not r.ok]:
                raise RuntimeError(f"publish failed: {failed[0]}")
    finally:
        await broker.close()


@contextmanager
def nats_target(consumers: list[str], n: int) -> Iterator[Target]:
    with NatsServer() as server:
        url = f"{server.url}?stream={STREAM}&subjects=bench.order.>&timeout=30"
        asyncio.run(publish(NatsBroker(url), messages(n)))
        yield Target("nats", f"{server.url}?stream={STREAM}", nats_subscription)


def nats_subscription(url: str, consumer: str) -> Subscription:
    return NatsSubscription(url, consumer, [PATTERN])


@contextmanager
def redis_target(consumers: list[str], n: int) -> Iterator[Target]:
    """Keys of the run's own (``?prefix=``), deleted afterwards."""
    prefix = f"bench-inbox-{uuid.uuid4().hex[:8]}:"
    url = f"{REDIS}?prefix={prefix}"
    try:
        asyncio.run(publish(RedisBroker(f"{url}&timeout=30"), messages(n)))
        yield Target("redis", url, redis_subscription)
    finally:
        client = redis.Redis.from_url(REDIS)
        if keys := list(client.scan_iter(match=f"{prefix}*")):
            client.delete(*keys)
        client.close()


def redis_subscription(url: str, consumer: str) -> Subscription:
    return RedisSubscription(url, consumer, [PATTERN])


@contextmanager
def rabbitmq_target(consumers: list[str], n: int) -> Iterator[Target]:
    """An exchange of the run's own and every run's queue declared (bound) before the
    publish, so each queue holds all the messages; all deleted afterwards."""
    exchange = f"bench-inbox-{uuid.uuid4().hex[:8]}"
    url = f"{RABBITMQ}?exchange={exchange}"
    try:
        for consumer in consumers:
            asyncio.run(opened_and_closed(rabbitmq_subscription(url, consumer)))
        asyncio.run(publish(RabbitBroker(f"{url}&timeout=30"), messages(n)))
        yield Target("rabbitmq", url, rabbitmq_subscription)
    finally:
        asyncio.run(delete_rabbitmq(exchange, consumers))


def rabbitmq_subscription(url: str, consumer: str) -> Subscription:
    return RabbitSubscription(url, consumer, [PATTERN])


async def opened_and_closed(subscription: Subscription) -> None:
    await subscription.open()
    await subscription.close()


async def delete_rabbitmq(exchange: str, queues: list[str]) -> None:
    connection = await aio_pika.connect(RABBITMQ)
    try:
        channel = await connection.channel()
        for queue in queues:
            await channel.queue_delete(queue)
        await channel.exchange_delete(exchange)
    finally:
        await connection.close()


TARGETS: dict[str, Callable[[list[str], int], AbstractContextManager[Target]]] = {
    "nats": nats_target,
    "redis": redis_target,
    "rabbitmq": rabbitmq_target,
}


def order_of_runs(runs: int) -> list[tuple[int, str]]:
    """alone, inbox, inbox, alone, ...: neither mode always first against the drift."""
    return [(i, mode) for i in range(runs) for mode in (MODES if i % 2 == 0 else MODES[::-1])]


def bench_broker(db: str, name: str, n: int, runs: int, tag: str) -> dict[str, list[Figures]]:
    """The broker's runs, by mode (after a warm-up run that is not counted)."""
    plan = order_of_runs(runs)
    names = {(i, mode): f"bench_{tag}_{mode}_{i}" for i, mode in plan}
    warm = f"bench_{tag}_warm"
    engine = engine_from(db)
    backends = Backends(engine)
    figures: dict[str, list[Figures]] = {mode: [] for mode in MODES}
    try:
        with TARGETS[name]([warm, *names.values()], n) as target:
            consume(engine, backends, target, warm, "inbox", min(n, WARM_UP))
            for i, mode in plan:
                run = consume(engine, backends, target, names[(i, mode)], mode, n)
                figures[mode].append(run)
    finally:
        engine.dispose()
    return figures


def median(figures: list[Figures], field: str) -> float:
    return float(statistics.median(getattr(f, field) for f in figures))


def each(figures: list[Figures], field: str) -> str:
    return " ".join(f"{getattr(f, field):.0f}" for f in figures)


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def report(results: dict[str, dict[str, list[Figures]]], n: int, runs: int, loads: str) -> None:
    rows = [("broker", "mode", "msg/s", "msg/s per run", "in hand us", "CPU us/msg",
             "CPU us/msg per run", "PG CPU us/msg")]  # fmt: skip
    for name, by_mode in results.items():
        for mode in MODES:
            figs = by_mode[mode]
            rows.append((name, mode, f"{median(figs, 'rate'):.0f}", each(figs, "rate"),
                         f"{median(figs, 'in_hand_us'):.0f}", f"{median(figs, 'cpu_us'):.0f}",
                         each(figs, "cpu_us"), f"{median(figs, 'db_cpu_us'):.0f}"))  # fmt: skip
    print_rows(f"Consumer throughput, {n} messages a run, medians of {runs} runs "
               f"(load average 1/5/15 min {loads})", rows)  # fmt: skip
    ratios = [("broker", "msg/s inbox/alone", "CPU/msg inbox/alone", "row us/msg (from msg/s)",
               "row us in hand", "row CPU us/msg", "row PG CPU us/msg")]  # fmt: skip
    for name, by_mode in results.items():
        a, b = (by_mode[m] for m in MODES)
        rate_a, rate_b = median(a, "rate"), median(b, "rate")
        cpu_a, cpu_b = median(a, "cpu_us"), median(b, "cpu_us")
        ratios.append((name, f"{rate_b / rate_a:.2f}x", f"{cpu_b / cpu_a:.2f}x",
                       f"{1e6 / rate_b - 1e6 / rate_a:.0f}",
                       f"{median(b, 'in_hand_us') - median(a, 'in_hand_us'):.0f}",
                       f"{cpu_b - cpu_a:.0f}",
                       f"{median(b, 'db_cpu_us') - median(a, 'db_cpu_us'):.0f}"))  # fmt: skip
    print_rows("The inbox against the handler alone (differences and ratios of medians)", ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description="the consumer's inbox: throughput and cost")
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=3, help="runs of each mode per broker")
    parser.add_argument("--brokers", default="nats,redis,rabbitmq", help="comma-separated")
    args = parser.parse_args()
    chosen = [b for b in args.brokers.split(",") if b]
    if unknown := [b for b in chosen if b not in TARGETS]:
        parser.error(f"--brokers: one of {', '.join(TARGETS)}, got {', '.join(unknown)}")
    if args.messages < 1 or args.runs < 1:
        parser.error("--messages and --runs: at least 1")
    before = load()
    results: dict[str, dict[str, list[Figures]]] = {}
    with bench_schema() as db:
        migrate.upgrade(db)
        engine = engine_from(db)
        business.create_all(engine)
        engine.dispose()
        tag = uuid.uuid4().hex[:8]
        for name in chosen:
            results[name] = bench_broker(db, name, args.messages, args.runs, tag)
    report(results, args.messages, args.runs, f"{before} before, {load()} after")


if __name__ == "__main__":
    main()
