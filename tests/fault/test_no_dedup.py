"""Faults on brokers that keep every copy (Redis Streams, RabbitMQ): nothing lost, no
phantom, and duplicates bounded by what was in flight when the fault struck.

JetStream drops a second copy of a msg_id inside its dedup window (the scenarios in
test_faults.py); these brokers do not, so a redelivery shows. The bound per fault is
what the relay had published but not yet marked when it struck:
- ``kill``: the killed app's messages, all of which it may have published (50);
- ``drop``: publishes the broker got whose answers were lost, at most ``max_in_flight``
  (fast path) plus ``sweep_batch`` (sweeper) per connection lost (two: the drop, then
  the cut at its end);
- ``db-kill``: every ack whose mark failed (``mark_failed``), exactly once each.
The relay reaches the broker through a TcpProxy; the copies are read back with
``outbox export broker``'s own readers.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aio_pika
import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from outbox.table import PENDING, outbox_message
from relay import export
from relay.brokers import reader_for
from relay.lab.compare.run import KILLED_APP_MESSAGES, QUICK_OUTBOX
from relay.testing.faults import MarkKiller, TcpProxy, kill_app_after_commit
from tests.helpers import wait_until
from tests.servers import RedisServer

RABBIT = "amqp://guest:guest@127.0.0.1:5672/"
MAX_IN_FLIGHT = 16
SWEEP_BATCH = 16  # small, so that the drop's bound (64) is below the 300 messages sent
MESSAGES = 300
FAULT_S = 2.0


@dataclass
class Broker:
    """A broker of the test's own, reached through ``proxy``; ``copies()`` reads it back."""

    url: str  # through the proxy
    proxy: TcpProxy
    copies: Callable[[], list[str]]  # msg_id of every copy the broker holds


def msg_ids(parquet: Path) -> list[str]:
    """msg_id of every copy in a broker export."""
    return [str(m) for m in pq.read_table(parquet).column("msg_id").to_pylist()]


@pytest.fixture
def redis_broker(tmp_path: Path, topic: str) -> Iterator[Broker]:
    server = RedisServer().start()
    proxy = TcpProxy(server.port).start()
    out = tmp_path / "redis.parquet"

    def copies() -> list[str]:
        export.export_broker(reader_for(server.url), [topic], out)
        return msg_ids(out)

    try:
        yield Broker(f"redis://127.0.0.1:{proxy.port}/0", proxy, copies)
    finally:
        proxy.stop()
        server.close()


@pytest.fixture
def rabbitmq_broker(tmp_path: Path) -> Iterator[Broker]:
    """The machine's RabbitMQ with an exchange and an audit stream of this test's own."""
    tag = uuid.uuid4().hex[:10]
    exchange, audit = f"fault-{tag}", f"fault-audit-{tag}"
    proxy = TcpProxy(5672).start()
    out = tmp_path / "rabbit.parquet"

    def copies() -> list[str]:
        export.export_broker(reader_for(f"{RABBIT}?exchange={exchange}"), [audit], out)
        return msg_ids(out)

    try:
        yield Broker(
            f"amqp://guest:guest@127.0.0.1:{proxy.port}/?exchange={exchange}&audit={audit}",
            proxy,
            copies,
        )
    finally:
        proxy.stop()
        asyncio.run(delete_rabbit(exchange, audit))


async def delete_rabbit(exchange: str, queue: str) -> None:
    connection = await aio_pika.connect(RABBIT)
    channel = await connection.channel()
    await channel.queue_delete(queue)
    await channel.exchange_delete(exchange)
    await connection.close()


@pytest.fixture
def topic() -> str:
    return f"fault{uuid.uuid4().hex[:10]}.orders"


def pending(engine: Engine) -> int:
    with engine.connect() as conn:
        query = select(func.count()).where(outbox_message.c.status == PENDING)
        return int(conn.execute(query).scalar_one())


def committed(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return {str(m) for m in conn.execute(select(outbox_message.c.msg_id)).scalars()}


def send_paced(ob: Outbox, topic: str, count: int, rate: float) -> None:
    for i in range(count):
        with Session(ob.engine) as session, session.begin():
            ob.send(session, topic, {"i": i})
        time.sleep(1 / rate)


def inject(fault: str, broker: Broker, killer: MarkKiller, pg_url: str, topic: str) -> int | None:
    """Inject ``fault`` while traffic flows; returns the bound on duplicates it allows
    (None for db-kill: there it is exactly mark_failed, known once the run is over)."""
    if fault == "kill":
        kill_app_after_commit(pg_url, broker.url, topic, KILLED_APP_MESSAGES)
        return KILLED_APP_MESSAGES
    if fault == "drop":
        broker.proxy.drop_for(FAULT_S)
        return 2 * (MAX_IN_FLIGHT + SWEEP_BATCH)
    killer.arm()
    time.sleep(FAULT_S)
    killer.disarm()
    assert killer.kills > 0, "the fault struck no mark"
    return None


@pytest.mark.parametrize("fault", ["kill", "drop", "db-kill"])
@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
def test_duplicates_bounded_by_the_in_flight_count(
    kind: str, fault: str, pg_url: str, topic: str, request: pytest.FixtureRequest
) -> None:
    broker: Broker = request.getfixturevalue(f"{kind}_broker")
    migrate.upgrade(pg_url)
    engine = create_engine(pg_url, pool_pre_ping=True)
    killer = MarkKiller(engine)
    # Marks every 200 ms: while marks are killed (each try costs a terminate and a
    # reconnect) the ack thread is busy a fraction of the time, so a mark is either
    # given up (mark_failed) or written well within the sweeper's age, never both
    # published again and marked late.
    ob = Outbox(
        engine,
        broker=broker.url,
        **QUICK_OUTBOX,
        max_in_flight=MAX_IN_FLIGHT,
        sweep_batch=SWEEP_BATCH,
        ack_flush_ms=200,
    )
    ob.start()
    traffic = threading.Thread(target=send_paced, args=(ob, topic, MESSAGES, 150.0))
    try:
        traffic.start()
        wait_until(
            lambda: ob.stats is not None and ob.stats.published >= 50,
            what="traffic flowing before the fault",
        )
        bound = inject(fault, broker, killer, pg_url, topic)
        traffic.join()
        wait_until(lambda: pending(engine) == 0, timeout=90, what="every row marked")
        ids = committed(engine)
    finally:
        traffic.join()
        ob.stop()
        killer.close()
        engine.dispose()
    stats = ob.stats
    assert stats is not None
    copies = broker.copies()
    duplicates = len(copies) - len(set(copies))
    print(f"{kind} {fault}: committed={len(ids)} copies={len(copies)} duplicates={duplicates} "
          f"mark_failed={stats.mark_failed} bound={bound}")  # fmt: skip
    assert set(copies) == ids, "lost or phantom messages"
    assert max(Counter(copies).values()) <= 2
    if fault == "db-kill":
        assert stats.mark_failed > 0
        assert duplicates == stats.mark_failed, "each unmarked ack published once more"
    else:
        assert bound is not None and duplicates <= bound
