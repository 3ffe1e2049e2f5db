"""The sweeper against real PostgreSQL (and nats-server where a broker's answer matters)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, event, func, select, text, update
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Outbox, migrate, outbox_message
from outbox.broker import Broker, PublishResult
from outbox.message import Message
from outbox.settings import Settings
from relay.brokers.nats import NatsBroker, read_stream
from relay.loop import BrokerLoop
from relay.sweep.jobs import SweeperJobs
from relay.sweep.sweeper import Sweeper
from relay.testing.embedded import NatsServer
from relay.testing.faults import FaultyBroker
from relay.testing.memory import MemoryBroker
from tests.helpers import running

t = outbox_message
OUTBOX = str(Path(sys.executable).with_name("outbox"))
QUICK = Settings(sweeper_age_s=0.5, handoff_limit_s=0.2, backoff_base_s=0.01, backoff_cap_s=0.05)


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    migrate.upgrade(pg_url)
    eng = create_engine(pg_url, pool_size=10)
    yield eng
    eng.dispose()


def commit_messages(
    engine: Engine, n: int, topic: str = "sw.x", payload: bytes = b"{}"
) -> list[str]:
    # An app that raised its limit: 1 MiB payloads pass send(), as the tests below need.
    ob = Outbox(engine, max_payload_bytes=2 * 1024 * 1024)
    with Session(engine) as session, session.begin():
        return [ob.send(session, topic, payload) for _ in range(n)]


def age_rows(engine: Engine, seconds: int = 60) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                f"UPDATE outbox_message SET created_at = created_at - interval '{seconds} seconds'"
            )
        )


def statuses(engine: Engine) -> Counter[str]:
    with engine.connect() as conn:
        return Counter(
            dict(conn.execute(select(t.c.status, func.count()).group_by(t.c.status)).all())
        )


def test_skip_locked_takes_exactly_the_unlocked_rows(
    engine: Engine, loops: list[BrokerLoop]
) -> None:
    """Another transaction locks 2 of 4 due rows; the sweeper must take exactly the other 2."""
    ids = commit_messages(engine, 4)
    age_rows(engine)
    broker = MemoryBroker()
    sweeper = Sweeper(engine, running(broker, loops), QUICK)
    with engine.connect() as holder:
        holder.execute(
            select(t.c.id).where(t.c.msg_id.in_([uuid.UUID(i) for i in ids[:2]])).with_for_update()
        ).all()
        result = sweeper.sweep_once()
        assert result.claimed == 2 and result.sent == 2
        assert sorted(m.msg_id for m in broker.published) == sorted(ids[2:])
        holder.rollback()
    assert sweeper.sweep_once().sent == 2
    assert statuses(engine) == Counter({"sent": 4})


def test_only_rows_older_than_the_threshold_are_taken(
    engine: Engine, loops: list[BrokerLoop]
) -> None:
    commit_messages(engine, 3)
    sweeper = Sweeper(engine, running(MemoryBroker(), loops), Settings())
    assert sweeper.sweep_once().claimed == 0, "rows younger than 10 s belong to the fast path"
    age_rows(engine, 11)
    assert sweeper.sweep_once().claimed == 3


def test_row_of_a_long_transaction_is_delivered_after_it_commits(
    engine: Engine, loops: list[BrokerLoop]
) -> None:
    """A bug here (an id cursor moving past uncommitted ids) would skip the late row forever."""
    broker = MemoryBroker()
    sweeper = Sweeper(engine, running(broker, loops), QUICK)
    ob = Outbox(engine)
    long_tx = Session(engine)
    late = ob.send(long_tx, "sw.x", b"late")  # inserted first, gets the lower id
    later = commit_messages(engine, 5)
    deadline = time.monotonic() + 10
    while len(broker.published) < 5 and time.monotonic() < deadline:
        sweeper.sweep_once()
    assert {m.msg_id for m in broker.published} == set(later)
    long_tx.commit()
    long_tx.close()
    deadline = time.monotonic() + 10
    while late not in {m.msg_id for m in broker.published} and time.monotonic() < deadline:
        sweeper.sweep_once()
    assert late in {m.msg_id for m in broker.published}


def test_poison_message_goes_dead_while_healthy_ones_flow(
    engine: Engine, nats_server: NatsServer, stream: tuple[str, str], loops: list[BrokerLoop]
) -> None:
    name, prefix = stream
    settings = Settings(
        sweeper_age_s=0.5,
        handoff_limit_s=0.2,
        max_attempts=3,
        backoff_base_s=0.01,
        backoff_cap_s=0.05,
    )
    relay = running(NatsBroker(f"{nats_server.url}?stream={name}&subjects={prefix}.>"), loops)
    healthy = commit_messages(engine, 1000, f"{prefix}.ok")
    # 1 MiB passes send() (limit 2 MiB) but, with its headers, exceeds the server's 1 MiB.
    [poison] = commit_messages(engine, 1, f"{prefix}.big", b"x" * (1024 * 1024))
    age_rows(engine)
    sweeper = Sweeper(engine, relay, settings)
    deadline = time.monotonic() + 30
    while statuses(engine)["dead"] == 0 and time.monotonic() < deadline:
        sweeper.sweep(concurrency=1)
    assert statuses(engine) == Counter({"sent": 1000, "dead": 1})
    with engine.connect() as conn:
        row = conn.execute(select(t).where(t.c.msg_id == uuid.UUID(poison))).one()
    assert row.attempts == 3 and "MaxPayload" in row.last_error
    stored = asyncio.run(read_stream(nats_server.url, name))
    assert sorted(str(m.msg_id) for m in stored) == sorted(healthy)
    requeue = [OUTBOX, "requeue", "--db", engine.url.render_as_string(False), "--dead"]
    done = subprocess.run(requeue, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "requeued 1" in done.stdout, done.stderr
    assert statuses(engine) == Counter({"sent": 1000, "pending": 1})


def test_a_permanent_failure_goes_dead_after_permanent_attempts_a_retryable_one_does_not(
    engine: Engine, nats_server: NatsServer, stream: tuple[str, str], loops: list[BrokerLoop]
) -> None:
    """nats-server refuses the oversized message for good (max_payload): dead after
    permanent_attempts, not max_attempts; a retryable failure keeps its schedule."""
    from outbox.broker import retry

    name, prefix = stream
    [nacked] = commit_messages(engine, 1, f"{prefix}.flaky")
    [big] = commit_messages(engine, 1, f"{prefix}.big", b"x" * (1024 * 1024))
    age_rows(engine)
    nats = NatsBroker(f"{nats_server.url}?stream={name}&subjects={prefix}.>")
    broker = FaultyBroker(nats, {nacked: retry("nacked")})
    settings = Settings(permanent_attempts=2, max_attempts=20, sweep_batch=10)
    sweeper = Sweeper(engine, running(broker, loops), settings)
    for sweep in (1, 2, 3):  # as `outbox drain` does: every row once per sweep
        result = sweeper.sweep(min_age_s=0, due_only=False)
        assert result.dead == (1 if sweep == 2 else 0), sweep
    with engine.connect() as conn:
        rows = {str(r.msg_id): r for r in conn.execute(select(t))}
    assert (rows[big].status, rows[big].attempts) == ("dead", 2)
    assert rows[big].last_error.startswith("permanent: ") and "MaxPayload" in rows[big].last_error
    assert (rows[nacked].status, rows[nacked].attempts) == ("pending", 3)


def test_failures_back_off_and_are_not_retaken_before_due(
    engine: Engine, loops: list[BrokerLoop]
) -> None:
    from outbox.broker import retry

    broker = MemoryBroker(policy=lambda m: retry("down"))
    sweeper = Sweeper(engine, running(broker, loops), Settings(backoff_base_s=30, backoff_cap_s=60))
    commit_messages(engine, 3)
    age_rows(engine)
    assert sweeper.sweep_once().failed == 3
    assert sweeper.sweep_once().claimed == 0, "backed-off rows are not due yet"
    with engine.connect() as conn:
        rows = conn.execute(
            select(t.c.attempts, t.c.last_error, t.c.next_attempt_at, func.now())
        ).all()
    for attempts, error, next_at, now in rows:
        assert attempts == 1 and error == "retry: down"
        assert 14 <= (next_at - now).total_seconds() <= 31  # 30 s with jitter in [0.5, 1]


def test_retention_purges_only_old_sent_and_canceled_rows(
    engine: Engine, loops: list[BrokerLoop]
) -> None:
    """Sent rows go by sent_at, canceled ones by created_at; pending and dead rows stay."""
    ids = commit_messages(engine, 8)
    rows = zip(
        ids,
        ["sent", "sent", "sent", "pending", "dead", "sent", "canceled", "canceled"],
        [4, 4, 4, 4, 4, 1, 4, 1],
        strict=True,
    )
    with engine.begin() as conn:
        for msg_id, status, age in rows:
            then = func.now() - text(f"interval '{age} days'")
            conn.execute(
                update(t)
                .where(t.c.msg_id == uuid.UUID(msg_id))
                .values(status=status, created_at=then, sent_at=then if status == "sent" else None)
            )
    sweeper = Sweeper(engine, running(MemoryBroker(), loops), Settings(purge_batch=2))
    assert sweeper.purge() == 4
    with engine.connect() as conn:
        left = {str(m) for m in conn.execute(select(t.c.msg_id)).scalars()}
    assert left == {*ids[3:6], ids[7]}


class CountingBroker(Broker):
    """Wraps a real adapter and counts every publish it is asked to make, and the failed."""

    def __init__(self, inner: Broker) -> None:
        self.inner = inner
        self.counts: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.lock = threading.Lock()

    async def connect(self) -> None:
        await self.inner.connect()

    async def publish(self, messages: Sequence[Message]) -> list[PublishResult]:
        with self.lock:
            self.counts.update(m.msg_id for m in messages)
        results = await self.inner.publish(messages)
        with self.lock:
            self.failed.update(m.msg_id for m, r in zip(messages, results, strict=True) if not r.ok)
        return results

    async def close(self) -> None:
        await self.inner.close()


def test_four_sweepers_share_a_backlog_without_double_publishing(
    engine: Engine, nats_server: NatsServer, stream: tuple[str, str], loops: list[BrokerLoop]
) -> None:
    name, prefix = stream
    ids: list[str] = []
    for _ in range(10):
        ids += commit_messages(engine, 2000, f"{prefix}.backlog")
    age_rows(engine)
    brokers = [
        CountingBroker(NatsBroker(f"{nats_server.url}?stream={name}&subjects={prefix}.>"))
        for _ in range(4)
    ]
    sweepers = [Sweeper(engine, running(b, loops), QUICK) for b in brokers]
    threads = [threading.Thread(target=s.sweep) for s in sweepers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    counts = sum((b.counts for b in brokers), Counter())
    assert set(counts) == set(ids)
    # A publish that failed (a JetStream ack timing out on a loaded machine) is retried,
    # maybe by another sweeper: that is at least once. Only a second claim repeats a success.
    repeats = counts - sum((b.failed for b in brokers), Counter())
    assert max(repeats.values()) == 1, "a row was published by two sweepers"
    assert all(sum(b.counts.values()) > 0 for b in brokers), (
        "every sweeper should have taken a share"
    )
    assert statuses(engine) == Counter({"sent": 20_000})


def test_an_unreachable_broker_costs_the_rows_no_attempt(
    engine: Engine, nats_server: NatsServer, loops: list[BrokerLoop]
) -> None:
    """A bug here would walk a whole backlog towards dead during a broker outage."""
    nats_server.stop()
    commit_messages(engine, 1200)
    age_rows(engine)
    sweeper = Sweeper(engine, running(NatsBroker(nats_server.url), loops), Settings(max_attempts=2))
    result = sweeper.sweep(concurrency=2, min_age_s=0, due_only=False)
    assert result.aborted and result.failed == result.dead == 0
    with engine.connect() as conn:
        attempts = conn.execute(select(func.max(t.c.attempts))).scalar_one()
    assert attempts == 0 and statuses(engine) == Counter({"pending": 1200})


def test_a_drain_tries_each_failing_row_once(engine: Engine, loops: list[BrokerLoop]) -> None:
    from outbox.broker import retry

    broker = MemoryBroker(
        policy=lambda m: retry("refused for now") if m.payload == b"bad" else None
    )
    sweeper = Sweeper(engine, running(broker, loops), Settings(sweep_batch=50))
    commit_messages(engine, 120)
    commit_messages(engine, 30, payload=b"bad")
    result = sweeper.sweep(concurrency=2, min_age_s=0, due_only=False)
    assert (result.sent, result.failed) == (120, 30)
    with engine.connect() as conn:
        assert conn.execute(select(func.max(t.c.attempts))).scalar_one() == 1


def test_big_payloads_are_loaded_after_the_claim_a_few_at_a_time(
    any_db: str, loops: list[BrokerLoop]
) -> None:
    """Big payloads come in queries of about 4 MiB, not with the claim: a claim of many
    MiB would hold the GIL for tens of milliseconds in one go. Each arrives intact."""
    migrate.upgrade(any_db)
    engine = create_engine(any_db, poolclass=NullPool)
    big = [bytes([65 + i]) * (1024 * 1024) for i in range(5)]
    small = commit_messages(engine, 2, payload=b'{"small":1}')
    large = [commit_messages(engine, 1, payload=p)[0] for p in big]
    broker = MemoryBroker()
    selects: list[str] = []

    def count(conn: object, cursor: object, statement: str, *_: object) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "payload" in statement:
            selects.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        sweeper = Sweeper(engine, running(broker, loops), QUICK)
        assert sweeper.sweep_once(min_age_s=-60).sent == 7  # rows of any age
    finally:
        event.remove(engine, "before_cursor_execute", count)
        engine.dispose()
    published = {m.msg_id: m.payload for m in broker.published}
    assert [published[m] for m in large] == big
    assert all(published[m] == b'{"small":1}' for m in small)
    # The claims (one statement, or on PostgreSQL the retries' and the rows by age apart)
    # bring the payloads' sizes; the loads are the others.
    loads = [sql for sql in selects if "CASE WHEN" not in sql]
    assert len(loads) == 2, "after the claim, 4 x 1 MiB, then the last 1 MiB"


def test_a_sweeper_waits_for_the_schema_at_head(
    pg_url: str, loops: list[BrokerLoop], caplog: pytest.LogCaptureFixture
) -> None:
    """A schema one migration behind (MariaDB before 0003 wrote local times) is not swept:
    the sweeper would compare those times with a UTC clock. A bug: the rows go out, or
    the problem is logged on every interval instead of once."""
    migrate.upgrade(pg_url, "0002")
    engine = create_engine(pg_url, poolclass=NullPool)
    try:
        commit_messages(engine, 3)
        age_rows(engine)
        sweeper = Sweeper(engine, running(MemoryBroker(), loops), Settings())
        jobs = SweeperJobs(sweeper, retention=False)
        jobs._sweep()
        jobs._sweep()
        assert statuses(engine) == Counter({"pending": 3})
        paused = [r for r in caplog.records if "sweeper paused" in r.getMessage()]
        assert len(paused) == 1 and "run `outbox migrate`" in paused[0].getMessage()
        migrate.upgrade(pg_url)
        jobs._sweep()
        assert statuses(engine) == Counter({"sent": 3})
    finally:
        engine.dispose()
