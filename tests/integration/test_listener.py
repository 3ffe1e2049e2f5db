"""An app's own listener on a real Outbox (PostgreSQL + nats-server): tests wait on it.

``published`` is heard after the rows are marked, so a test can wait on an Event set
by the hook and then read the table once, instead of polling it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from prometheus_client import CollectorRegistry
from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from outbox.events import Path, RelayListener, Sent
from outbox.table import SENT
from outbox.table import outbox_message as t
from relay.metrics import register
from relay.testing.embedded import NatsServer


class Published(RelayListener):
    """Collects published msg_ids; ``done`` is set once ``count`` were heard."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.msg_ids: set[str] = set()
        self.paths: set[str] = set()
        self.done = threading.Event()
        self._lock = threading.Lock()

    def published(self, sent: Sequence[Sent], path: Path) -> None:
        with self._lock:
            self.msg_ids |= {s.msg_id for s in sent}
            self.paths.add(path)
            if len(self.msg_ids) >= self.count:
                self.done.set()


class Broken(RelayListener):
    def __init__(self) -> None:
        self.calls = 0

    def published(self, sent: Sequence[Sent], path: Path) -> None:
        self.calls += 1
        raise RuntimeError("an app's listener bug")


def send_orders(ob: Outbox, topic: str, n: int) -> list[str]:
    with Session(ob.engine) as session, session.begin():
        return [ob.send(session, topic, {"i": i}) for i in range(n)]


def statuses(ob: Outbox) -> dict[str, str]:
    with ob.engine.connect() as conn:
        return {str(m): s for m, s in conn.execute(select(t.c.msg_id, t.c.status))}


def test_a_test_waits_on_the_listener_then_reads_the_table_once(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    name, prefix = stream
    migrate.upgrade(pg_url)
    first, broken = Published(20), Broken()
    ob = Outbox(pg_url, f"{nats_server.url}?stream={name}&subjects={prefix}.>", listener=first)
    ob.add_listener(broken)  # logged, never in the way
    registry = CollectorRegistry()
    register(ob, registry)  # before start: it counts everything
    ob.start()
    try:
        sent = send_orders(ob, f"{prefix}.orders", 20)
        assert first.done.wait(10), "published was not heard for every message"
        assert statuses(ob) == dict.fromkeys(sent, SENT)  # marked before the hook
        late = Published(5)
        ob.add_listener(late)  # while running
        more = send_orders(ob, f"{prefix}.orders", 5)
        assert late.done.wait(10)
        fast = registry.get_sample_value("outbox_messages_sent_total", {"path": "fast"})
    finally:
        ob.stop()
    assert first.msg_ids == {*sent, *more} and late.msg_ids == set(more)
    assert first.paths == {"fast"}
    assert broken.calls >= 2
    assert fast == 25
