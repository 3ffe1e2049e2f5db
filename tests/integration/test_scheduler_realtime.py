"""In real time: 10,000 messages sent with ``send(delay=...)``, delays spread over 60 s,
through the app's own relay (``Outbox.start()``) to a real nats-server, on PostgreSQL:
all delivered, none early.

"Early" is judged by clocks that can be defended: JetStream's stored timestamp (the
server's wall clock when it stored the message, before its ack) against the row's
``deliver_at`` (the database's clock), through an upper bound of the database's offset
from this host's wall clock measured here (both servers are on this host: one kernel
clock). The lateness is printed (bench/delayed.py measures it), never asserted.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import threading
from collections.abc import Sequence

from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.events import Path, RelayListener, Sent
from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer
from tests.helpers import migrated
from tests.scheduling import db_offset_bound_s, due_times, early

MESSAGES = 10_000
SPREAD_S = 60.0
COMMITS = 100  # transactions of 100 messages each, all sent in the first seconds


class Counting(RelayListener):
    """Sets ``done`` once ``n`` messages were published."""

    def __init__(self, n: int) -> None:
        self.n, self.count, self.lock, self.done = n, 0, threading.Lock(), threading.Event()

    def published(self, sent: Sequence[Sent], path: Path) -> None:
        with self.lock:
            self.count += len(sent)
            if self.count >= self.n:
                self.done.set()


def test_ten_thousand_scheduled_over_a_minute_none_early(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    name, prefix = stream
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    rng = random.Random(25)
    delays = [rng.uniform(0.5, SPREAD_S) for _ in range(MESSAGES)]
    heard = Counting(MESSAGES)
    with migrated(pg_url) as engine:
        ob = Outbox(engine, broker, listener=heard)
        ob.start()
        try:
            assert ob.relay is not None and ob.relay.wait_connected(30)
            per = MESSAGES // COMMITS
            for i in range(COMMITS):
                with Session(engine) as session, session.begin():
                    for delay in delays[i * per : (i + 1) * per]:
                        ob.send(session, f"{prefix}.sch", b"{}", delay=delay)
            assert heard.done.wait(SPREAD_S + 120), f"published {heard.count} of {MESSAGES}"
        finally:
            ob.stop(10)
        due = due_times(engine)
        offset = db_offset_bound_s(engine)
    stored = asyncio.run(read_stream(nats_server.url, name))
    arrived = {m.msg_id: m.time for m in stored if m.msg_id and m.time}
    assert sorted(arrived) == sorted(due), "every scheduled message, once"
    assert len(stored) == MESSAGES
    assert early(arrived, due, offset) == []
    late_ms = sorted((arrived[m] - due[m]).total_seconds() * 1000 for m in due)
    p99 = late_ms[int(len(late_ms) * 0.99)]
    print(
        f"lateness (JetStream stored time - deliver_at): p50 {statistics.median(late_ms):.1f} ms,"
        f" p99 {p99:.1f} ms, max {late_ms[-1]:.1f} ms, min {late_ms[0]:.2f} ms;"
        f" db offset bound {offset * 1000:.3f} ms"
    )
