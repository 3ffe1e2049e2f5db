"""The fast path end to end: real PostgreSQL, a real nats-server, the relay thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, event, func, select, text
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Outbox, migrate, outbox_message
from relay.brokers.nats import StoredMessage, read_stream
from relay.testing.embedded import NatsServer
from tests.helpers import wait_until

t = outbox_message


StartOutbox = Callable[..., Outbox]


@pytest.fixture
def start_outbox(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> Iterator[StartOutbox]:
    """Starts outboxes on this test's schema and stream; stops them all at the end."""
    migrate.upgrade(pg_url)
    name, prefix = stream
    started: list[Outbox] = []

    def start(db: str = pg_url, **options: Any) -> Outbox:
        outbox = Outbox(
            db, broker=f"{nats_server.url}?stream={name}&subjects={prefix}.>", **options
        )
        outbox.start()
        started.append(outbox)
        return outbox

    yield start
    for outbox in started:
        outbox.stop(timeout=5)  # a no-op for one the test stopped itself


@pytest.fixture
def ob(start_outbox: StartOutbox) -> Outbox:
    return start_outbox()


def stored(server: NatsServer, stream: tuple[str, str]) -> list[StoredMessage]:
    return asyncio.run(read_stream(server.url, stream[0]))


def statuses(pg_url: str) -> Counter[str]:
    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.connect() as conn:
        found = Counter(
            {s: n for s, n in conn.execute(select(t.c.status, func.count()).group_by(t.c.status))}
        )
    engine.dispose()
    return found


def send_from_threads(
    ob: Outbox, topic: str, threads: int, per_thread: int, fail_every: int = 0
) -> list[str]:
    committed: list[str] = []
    lock = threading.Lock()

    @ob.transactional
    def one(session: Session, n: int) -> str:
        msg_id = ob.send(session, topic, {"n": n}, key=str(n % 7))
        if fail_every and n % fail_every == 0:
            raise ValueError("rolled back on purpose")
        return msg_id

    def worker(base: int) -> None:
        for i in range(per_thread):
            try:
                msg_id = one(base + i)
            except ValueError:
                continue
            with lock:
                committed.append(msg_id)

    pool = [threading.Thread(target=worker, args=(k * per_thread,)) for k in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return committed


def test_2000_messages_from_8_threads_land_exactly_once(
    ob: Outbox, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    committed = send_from_threads(ob, f"{stream[1]}.inbound", threads=8, per_thread=250)
    assert len(committed) == 2000
    wait_until(lambda: statuses(pg_url)["sent"] == 2000, timeout=30, what="all rows sent")
    at_broker = stored(nats_server, stream)
    assert sorted(m.msg_id for m in at_broker if m.msg_id) == sorted(committed)
    assert len(at_broker) == 2000, "each message exactly once in the stream"
    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.connect() as conn:
        receipts = dict(conn.execute(select(t.c.msg_id, t.c.receipt)).all())
        assert conn.execute(select(func.count()).where(t.c.sent_at.is_(None))).scalar_one() == 0
    engine.dispose()
    by_id = {m.msg_id: m for m in at_broker}
    for msg_id, receipt in receipts.items():
        assert receipt == f"{stream[0]}:{by_id[str(msg_id)].seq}"
    first = by_id[committed[0]]
    assert first.headers["Outbox-Key"] in {str(n) for n in range(7)}
    assert json.loads(first.data)["n"] >= 0


def test_rolled_back_messages_never_reach_the_broker(
    ob: Outbox, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    committed = send_from_threads(
        ob, f"{stream[1]}.inbound", threads=4, per_thread=100, fail_every=5
    )
    assert len(committed) == 320
    wait_until(lambda: statuses(pg_url)["sent"] == 320, timeout=30, what="committed rows sent")
    assert sorted(m.msg_id for m in stored(nats_server, stream) if m.msg_id) == sorted(committed)
    assert statuses(pg_url) == Counter({"sent": 320})


def test_broker_down_for_2_s_is_covered_by_the_time_wheel(
    ob: Outbox, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    """A bug here loses the messages sent while the broker was down, or marks them unsent."""
    topic = f"{stream[1]}.inbound"
    before = send_from_threads(ob, topic, threads=2, per_thread=50)
    wait_until(lambda: statuses(pg_url)["sent"] == 100, what="first 100 sent")
    nats_server.stop()
    down_at = time.monotonic()
    during = send_from_threads(ob, topic, threads=2, per_thread=50)
    time.sleep(max(0.0, 2.0 - (time.monotonic() - down_at)))  # the fault itself: 2 s of outage
    nats_server.start()
    after = send_from_threads(ob, topic, threads=2, per_thread=50)
    wait_until(lambda: statuses(pg_url)["sent"] == 300, timeout=60, what="all 300 sent")
    assert ob.stats is not None and ob.stats.retried > 0, "the outage must have caused retries"
    assert ob.stats.exhausted == 0
    ids = [m.msg_id for m in stored(nats_server, stream)]
    assert set(ids) == set(before + during + after)
    assert len(ids) == len(set(ids)), "Nats-Msg-Id dedup keeps retried publishes single"


def test_broker_down_past_the_schedule_leaves_rows_pending(
    start_outbox: StartOutbox, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    name, prefix = stream
    ob = start_outbox(sweeper=False)  # the sweeper is tested elsewhere; here only the fast path
    wait_until(lambda: stream_exists(nats_server, name), what="stream created")
    nats_server.stop()
    send_from_threads(ob, f"{prefix}.inbound", threads=2, per_thread=25)
    stats = ob.stats
    assert stats is not None
    wait_until(lambda: stats.exhausted + stats.too_old == 50, timeout=60, what="given up")
    assert statuses(pg_url) == Counter({"pending": 50}), "nothing may be marked sent without an ack"
    ob.stop(timeout=2)
    nats_server.start()
    assert stored(nats_server, stream) == []


def stream_exists(server: NatsServer, name: str) -> bool:
    try:
        asyncio.run(read_stream(server.url, name))
        return True
    except Exception:
        return False


def test_delete_mode_removes_acked_rows(
    start_outbox: StartOutbox, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    ob = start_outbox(mark_mode="delete")
    send_from_threads(ob, f"{stream[1]}.inbound", threads=2, per_thread=50)
    wait_until(lambda: ob.stats is not None and ob.stats.published == 100, what="published")
    wait_until(lambda: sum(statuses(pg_url).values()) == 0, what="rows deleted")
    assert len(stored(nats_server, stream)) == 100


def test_stop_leaves_no_thread_or_connection(
    start_outbox: StartOutbox, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    prefix = stream[1]
    app = f"outbox-test-{prefix}"
    threads_before = {th.ident for th in threading.enumerate()}
    ob = start_outbox(pg_url + f"&application_name={app}")
    send_from_threads(ob, f"{prefix}.inbound", threads=2, per_thread=20)
    wait_until(lambda: ob.stats is not None and ob.stats.published == 40, what="published")
    assert nats_clients(nats_server) >= 1 and pg_backends(app) >= 1
    ob.stop(timeout=30)
    assert {th.ident for th in threading.enumerate()} <= threads_before
    wait_until(lambda: nats_clients(nats_server) == 0, timeout=60, what="nats connection closed")
    wait_until(lambda: pg_backends(app) == 0, timeout=60, what="pg connections closed")
    assert statuses(pg_url) == Counter({"sent": 40}), "stop must flush the pending acks"


def nats_clients(server: NatsServer) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/connz", timeout=5) as resp:
        return int(json.load(resp)["num_connections"])


def pg_backends(application_name: str) -> int:
    from tests.conftest import PG_URL

    engine = create_engine(PG_URL, poolclass=NullPool)
    with engine.connect() as conn:
        n = conn.execute(
            text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :a"),
            {"a": application_name},
        ).scalar_one()
    engine.dispose()
    return int(n)


@pytest.fixture
def quick_ob(start_outbox: StartOutbox) -> Outbox:
    """An outbox whose retry schedule ends within about 100 ms."""
    return start_outbox(retry_delays_ms=(0, 5, 10, 20, 50), sweeper=False)


def test_commit_that_postgresql_turned_into_rollback_publishes_nothing(
    quick_ob: Outbox, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    """The app swallows a DB error and commits: PostgreSQL rolls back, after_commit fires anyway.

    Trusting after_commit alone, this message would be a phantom.
    """
    from sqlalchemy.exc import DBAPIError

    @quick_ob.transactional
    def handler(session: Session) -> None:
        quick_ob.send(session, f"{stream[1]}.inbound", b"must not be published")
        with contextlib.suppress(DBAPIError):  # the app carries on; the tx is aborted
            session.execute(text("SELECT 1/0"))

    handler()
    stats = quick_ob.stats
    assert stats is not None
    # Dropped in the app thread at COMMIT: the connection reported the aborted transaction.
    assert quick_ob.committed == 0 and stats.accepted == 0
    assert statuses(pg_url) == Counter()
    assert stored(nats_server, stream) == []


def test_session_joined_to_an_outer_transaction_that_rolls_back_publishes_nothing(
    quick_ob: Outbox, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    with quick_ob.engine.connect() as conn:
        outer = conn.begin()
        session = Session(bind=conn, join_transaction_mode="create_savepoint")
        quick_ob.send(session, f"{stream[1]}.inbound", b"must not be published")
        session.commit()  # releases a savepoint only
        session.close()
        stats = quick_ob.stats
        assert stats is not None
        wait_until(lambda: stats.not_visible >= 1, what="the relay to look while it is open")
        outer.rollback()
    wait_until(lambda: stats.exhausted == 1, what="the schedule to give the message up")
    assert stats.published == 0
    assert stored(nats_server, stream) == []


def test_verify_commit_reads_only_what_it_cannot_prove(
    start_outbox: StartOutbox, stream: tuple[str, str]
) -> None:
    """No SELECT for sessions whose COMMIT is certain; one for a batch that is not."""
    ob = start_outbox(sweeper=False)
    stats = ob.stats
    assert stats is not None
    selects: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if threading.current_thread().name.startswith("outbox-verify"):
            selects.append(statement)

    event.listen(ob.engine, "before_cursor_execute", count)
    send_from_threads(ob, f"{stream[1]}.certain", threads=2, per_thread=10)
    wait_until(lambda: stats.marked == 20, what="the certain commits marked")
    assert selects == [], "a session on the engine proves its COMMIT: nothing to re-read"
    with ob.engine.connect() as conn:  # bound to a Connection: the relay cannot tell
        session = Session(bind=conn)
        for n in range(10):
            ob.send(session, f"{stream[1]}.joined", {"n": n})
        session.commit()
        session.close()
    wait_until(lambda: stats.marked == 30, what="the joined session's messages marked")
    assert len(selects) == 1 and selects[0].lstrip().upper().startswith("SELECT")
    assert stats.not_visible == 0


def test_scoped_session_is_accepted(quick_ob: Outbox, pg_url: str, stream: tuple[str, str]) -> None:
    from sqlalchemy.orm import scoped_session, sessionmaker

    scoped = scoped_session(sessionmaker(quick_ob.engine))
    quick_ob.send(scoped, f"{stream[1]}.scoped", b"x")
    scoped.commit()
    scoped.remove()
    wait_until(lambda: statuses(pg_url)["sent"] == 1, what="the message sent")


def test_broker_down_15_s_while_committing_loses_nothing(
    start_outbox: StartOutbox, pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    """Default settings: the fast path gives up after ~5 s, the in-app sweeper finishes the job."""
    topic = f"{stream[1]}.inbound"
    ob = start_outbox()
    committed = send_from_threads(ob, topic, threads=2, per_thread=20)
    nats_server.stop()
    outage_ends = time.monotonic() + 15
    while time.monotonic() < outage_ends:  # the app keeps committing through the outage
        committed += send_from_threads(ob, topic, threads=2, per_thread=5)
        time.sleep(0.1)  # pacing the load, not waiting for anything
    nats_server.start()
    committed += send_from_threads(ob, topic, threads=2, per_thread=20)
    wait_until(lambda: statuses(pg_url)["sent"] == len(committed), timeout=60, what="all sent")
    ob.stop(timeout=5)
    assert statuses(pg_url) == Counter({"sent": len(committed)})
    ids = [m.msg_id for m in stored(nats_server, stream)]
    assert set(ids) == set(committed), "lost = 0"
    assert len(ids) == len(set(ids))
