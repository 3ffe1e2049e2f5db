"""Memory in a broker outage: ``queue_size`` bounds all the fast path holds, and nothing
committed past the bound is lost (real PostgreSQL, the wheel's nats-server)."""

from __future__ import annotations

import asyncio
import threading
import time

from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Outbox, migrate, outbox_message
from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer
from tests.helpers import wait_until

QUEUE_SIZE = 100
OUTAGE_S = 20.0
APP_THREADS = 4


def pending(pg_url: str) -> int:
    engine = create_engine(pg_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            query = select(func.count()).where(outbox_message.c.status != "sent")
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


class Commits:
    """App threads committing 1 to 3 messages per transaction as fast as they can."""

    def __init__(self, ob: Outbox, topic: str) -> None:
        self.ob, self.topic = ob, topic
        self.ids: list[str] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.errors: list[BaseException] = []

    def run(self, base: int) -> None:
        n = 0
        try:
            while not self.done.is_set():
                n += 1
                with Session(self.ob.engine) as session, session.begin():
                    ids = [
                        self.ob.send(session, self.topic, {"n": base + n, "k": k})
                        for k in range(1 + n % 3)
                    ]
                with self.lock:
                    self.ids += ids
        except BaseException as exc:  # reported by the test, not lost in a thread
            self.errors.append(exc)


def test_an_outage_at_full_commit_rate_holds_at_most_queue_size_and_loses_nothing(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    name, prefix = stream
    migrate.upgrade(pg_url)
    ob = Outbox(
        pg_url,
        broker=f"{nats_server.url}?stream={name}&subjects={prefix}.>",
        queue_size=QUEUE_SIZE,
        handoff_limit_s=2,
        sweeper_age_s=3,
        sweep_interval_s=0.2,
        sweep_batch=2000,
        backoff_base_s=0.1,
        backoff_cap_s=1,
        max_attempts=1_000_000,  # the outage must not send rows dead
    )
    ob.start()
    try:
        stats = ob.stats
        dispatcher = ob.relay.dispatcher if ob.relay is not None else None
        assert stats is not None and dispatcher is not None
        with Session(ob.engine) as session, session.begin():
            ob.send(session, f"{prefix}.warmup", {})
        wait_until(lambda: stats.marked == 1, timeout=30, what="the relay connected")
        nats_server.stop()

        commits = Commits(ob, f"{prefix}.orders")
        apps = [threading.Thread(target=commits.run, args=(k * 10**9,)) for k in range(APP_THREADS)]
        held_max, samples = 0, 0
        started = time.monotonic()
        for app in apps:
            app.start()
        # At full speed for 20 s, and on until the fast path has both refused commits and
        # freed slots (retries spent, too old) and taken new ones: whatever the machine's pace.
        while (
            time.monotonic() - started < OUTAGE_S
            or stats.queue_full == 0
            or ob.handed_off < 3 * QUEUE_SIZE
        ) and time.monotonic() - started < 180:
            held_max = max(held_max, dispatcher.held())
            samples += 1
            time.sleep(0.001)
        commits.done.set()
        for app in apps:
            app.join(30)
        assert not commits.errors, commits.errors
        held_max = max(held_max, dispatcher.held())
        committed = set(commits.ids)
        print(
            f"outage: {len(committed)} committed, {ob.handed_off} taken by the fast path, "
            f"{stats.queue_full} queue_full, held max {held_max} (peak {stats.held_peak}) "
            f"over {samples} samples"
        )
        assert held_max <= QUEUE_SIZE and stats.held_peak <= QUEUE_SIZE
        assert stats.queue_full > 0 and ob.handed_off >= 3 * QUEUE_SIZE
        assert stats.marked == 1, "nothing marked sent without an ack"

        nats_server.start()
        wait_until(lambda: pending(pg_url) == 0, timeout=240, what="every row sent")
        at_broker = [m.msg_id for m in asyncio.run(read_stream(nats_server.url, name))]
        delivered = set(at_broker)
        assert committed <= delivered, f"{len(committed - delivered)} committed messages lost"
        assert len(delivered - committed) == 1, "only the warm-up message besides"
        assert len(at_broker) == len(delivered), "JetStream keeps one copy of each msg_id"
        wait_until(lambda: dispatcher.held() == 0, what="every slot freed")
    finally:
        ob.stop(timeout=5)
