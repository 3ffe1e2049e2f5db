"""What an app's own test suite needs (docs/testing.md): ``ob.start(broker=..., sweeper=...)``
for one start, and ``ob.recording()``, which sees what the code under test sent even
when the test's outer transaction rolls back.

A bug would look like: a module-level Outbox publishing into the real broker, or its
sweeper publishing rows an earlier test run left into this run's MemoryBroker; a
recording that misses a rolled-back send, sees another Outbox's, or loses sends made
from other threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.errors import ConfigError
from relay.testing import MemoryBroker
from tests.helpers import migrated, unsent, wait_until
from tests.planting import plant

QUICK = {"sweeper_age_s": 0.2, "handoff_limit_s": 0.1, "sweep_interval_s": 0.05}


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """A migrated database (PostgreSQL, SQLite) and the app's engine on it; SQLite's with
    SQLAlchemy's hooks for real savepoints (docs/testing.md: without them pysqlite sends
    no BEGIN, so the RELEASE of a test's first savepoint commits it)."""
    with migrated(db_url) as engine:
        if engine.dialect.name == "sqlite":
            event.listen(engine, "connect", no_pysqlite_transactions)
            event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN"))
        yield engine


def no_pysqlite_transactions(dbapi_connection: Any, _record: object) -> None:
    dbapi_connection.isolation_level = None


def published_ids(broker: MemoryBroker) -> list[str]:
    return [m.msg_id for m in broker.published]


def test_start_with_a_broker_and_no_sweeper_for_this_start(engine: Engine) -> None:
    """A row an earlier run left pending stays out of this run's broker; a later start with
    the sweeper (the Outbox's default) publishes it: the row could be swept."""
    left = plant(engine, "shop.placed")
    ob = Outbox(engine, broker="nats://127.0.0.1:1", **QUICK)  # the app's real broker
    broker = MemoryBroker()
    ob.start(broker=broker, sweeper=False)
    try:
        assert ob.relay is not None and ob.relay.jobs is None  # no sweep job at all
        assert not [t for t in threading.enumerate() if t.name == "APScheduler"]
        with pytest.raises(ConfigError, match=r"^start: the relay already runs on "):
            ob.start(broker=MemoryBroker())  # another broker while running: stop() first
        ob.start()  # a plain start() while running does nothing
        with Session(engine) as session, session.begin():
            msg_id = ob.send(session, "shop.placed", {"sku": "A-1"})
        wait_until(lambda: msg_id in published_ids(broker), what="the fast path's publish")
    finally:
        ob.stop()
    assert published_ids(broker) == [msg_id]
    swept = MemoryBroker()
    ob.start(broker=swept)
    try:
        wait_until(lambda: left in published_ids(swept), what="the sweeper's publish")
    finally:
        ob.stop()


def test_a_given_broker_starts_even_where_the_relay_is_switched_off(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_START_RELAY", "false")
    ob = Outbox(engine, broker="")
    ob.start()
    assert ob.relay is None
    broker = MemoryBroker()
    ob.start(broker=broker, sweeper=False)
    try:
        with Session(engine) as session, session.begin():
            msg_id = ob.send(session, "shop.placed", {})
        wait_until(lambda: broker.published, what="the publish")
    finally:
        ob.stop()
    assert published_ids(broker) == [msg_id]


@pytest.fixture
def connection(engine: Engine) -> Iterator[Connection]:
    """A test's outer transaction, rolled back at the end (docs/testing.md's recipe)."""
    with engine.connect() as conn:
        outer = conn.begin()
        yield conn
        outer.rollback()
    assert unsent(str(engine.url)) == 0, "nothing the test wrote stayed"


def test_recording_sees_sends_whose_outer_transaction_rolls_back(
    engine: Engine, connection: Connection
) -> None:
    broker = MemoryBroker()
    ob = Outbox(engine)  # no broker of its own
    ob.start(broker=broker, sweeper=False)
    ob.start()  # the app factory's start() after the fixture's: nothing to do
    try:
        with ob.recording() as sent:
            session = Session(bind=connection, join_transaction_mode="create_savepoint")
            kept = ob.send(session, "shop.placed", {"sku": "A-1"}, key="A-1")
            session.commit()  # the code under test commits: a savepoint of the outer one
            dropped = ob.send(session, "shop.placed", {"sku": "B-2"})
            session.rollback()
            session.close()
        stats = ob.stats
        assert stats is not None and ob.handed_off == 1  # the relay had it (after_commit)
        wait_until(lambda: stats.not_visible, what="the relay's look for its row")
    finally:
        ob.stop()
    assert stats.published == 0  # its row is not committed (and the fixture rolls it back)
    assert [(m.msg_id, m.topic, m.key, m.payload) for m in sent] == [
        (kept, "shop.placed", "A-1", b'{"sku":"A-1"}'),
        (dropped, "shop.placed", None, b'{"sku":"B-2"}'),
    ]
    assert broker.published == []


def test_recordings_nest_overlap_and_keep_to_their_outbox(engine: Engine) -> None:
    ob, other = Outbox(engine), Outbox(engine)

    def send(outbox: Outbox, n: int) -> str:
        with Session(engine) as session, session.begin():
            return outbox.send(session, "shop.placed", {"n": n})

    first = send(ob, 0)  # before any recording: not recorded
    with ob.recording() as outer:
        a = send(ob, 1)
        with ob.recording() as inner:
            threads = [threading.Thread(target=send, args=(ob, 2 + i)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            send(other, 9)  # another Outbox's send
        b = send(ob, 7)
    send(ob, 8)  # after: not recorded
    assert len(inner) == 4 and a not in {m.msg_id for m in inner}
    assert [m.msg_id for m in outer] == [a, *(m.msg_id for m in inner), b]
    assert first not in {m.msg_id for m in outer} and not ob._recordings
