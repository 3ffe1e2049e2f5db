"""The scheduler against real PostgreSQL, MariaDB and SQLite (one relay there: no SKIP
LOCKED): due rows go out, rows not due stay, a failing row backs off alone, several
relays on one table publish each row once, and a hinted row goes out on time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path as FilePath

import pytest
from sqlalchemy import Engine, select

from outbox import outbox_message
from outbox.broker import retry
from outbox.events import Path, RelayListener, Sent
from outbox.settings import Settings
from relay.loop import BrokerLoop
from relay.runtime import Relay
from relay.sweep.scheduler import Scheduler
from relay.sweep.sweeper import Sweeper
from relay.testing.embedded import NatsServer
from relay.testing.memory import MemoryBroker
from tests.helpers import migrated, running, wait_until
from tests.scheduling import db_offset_bound_s, due_times, early, schedule_rows, statuses

t = outbox_message
OUTBOX = str(FilePath(sys.executable).with_name("outbox"))
QUICK = Settings(sweep_interval_s=0.5, backoff_base_s=30.0, backoff_cap_s=60.0)


@pytest.fixture
def engine(any_db: str) -> Iterator[Engine]:
    with migrated(any_db) as eng:
        yield eng


@pytest.fixture(params=["postgresql", "mariadb"])
def locking_engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    """A database with SKIP LOCKED: several relays on one table."""
    url = request.getfixturevalue("pg_url" if request.param == "postgresql" else "mariadb_url")
    with migrated(url) as eng:
        yield eng


def scheduler(engine: Engine, broker: MemoryBroker, loops: list[BrokerLoop]) -> Scheduler:
    """A Scheduler not started: its ticks are called by the test."""
    return Scheduler(Sweeper(engine, running(broker, loops), QUICK))


def arrivals(broker: MemoryBroker) -> dict[str, datetime]:
    """When each message reached the broker, by this host's wall clock."""
    return {m.msg_id: at for m, at in zip(broker.published, broker._stored_at, strict=True)}


def test_due_rows_are_published_and_rows_not_due_are_not(
    engine: Engine, loops: list[BrokerLoop]
) -> None:
    past = schedule_rows(engine, "sch.due", [-5.0, -1.0, 0.0])
    future = schedule_rows(engine, "sch.later", [3600.0, 7200.0])
    broker = MemoryBroker()
    result = scheduler(engine, broker, loops).tick()
    assert result.sent == 3
    assert {m.msg_id for m in broker.published} == {m.msg_id for m in past}
    now = statuses(engine)
    assert [now[m.msg_id] for m in past] == ["sent"] * 3
    assert [now[m.msg_id] for m in future] == ["pending"] * 2
    assert scheduler(engine, broker, loops).tick().claimed == 0, "nothing else is due"


def test_the_sweeper_leaves_scheduled_rows_alone(engine: Engine, loops: list[BrokerLoop]) -> None:
    """Even a drain's sweep (any age, backoff ignored) never takes a scheduled row."""
    schedule_rows(engine, "sch.later", [3600.0])
    sweeper = Sweeper(engine, running(MemoryBroker(), loops), QUICK)
    assert sweeper.sweep(min_age_s=0, due_only=False).claimed == 0


def test_a_failing_row_backs_off_and_its_neighbours_go_out(
    engine: Engine, loops: list[BrokerLoop]
) -> None:
    rows = schedule_rows(engine, "sch.f", [-1.0] * 5)
    bad = rows[2].msg_id
    broker = MemoryBroker(
        policy=lambda m: retry("refused for the test") if m.msg_id == bad else None
    )
    sched = scheduler(engine, broker, loops)
    result = sched.tick()
    assert (result.sent, result.failed) == (4, 1)
    with engine.connect() as conn:
        row = conn.execute(select(t).where(t.c.msg_id == uuid.UUID(bad))).one()
    assert (row.status, row.attempts) == ("pending", 1)
    assert "refused for the test" in row.last_error
    assert row.next_attempt_at > row.deliver_at, "backing off"
    assert sched.tick().claimed == 0, "not retaken while it backs off"


def test_two_relays_publish_each_scheduled_row_once(
    locking_engine: Engine,
) -> None:
    """Two Relays (their own brokers) on one table, 400 rows due over 2 s: every row is
    published by exactly one of them."""
    rows = schedule_rows(locking_engine, "sch.two", [i * 0.005 for i in range(400)])
    brokers = [MemoryBroker(), MemoryBroker()]
    relays = [Relay(locking_engine, b, QUICK, fast_path=False, name=f"r{i}")
              for i, b in enumerate(brokers)]  # fmt: skip
    for relay in relays:
        relay.start()
    try:
        wait_until(lambda: sum(len(b.published) for b in brokers) >= len(rows), 60, "all rows")
    finally:
        for relay in relays:
            relay.stop(10)
    ids = [m.msg_id for b in brokers for m in b.published]
    assert sorted(ids) == sorted(m.msg_id for m in rows), "each row once, none twice"
    assert set(statuses(locking_engine).values()) == {"sent"}


class Published(RelayListener):
    def __init__(self) -> None:
        self.paths: list[str] = []

    def published(self, sent: Sequence[Sent], path: Path) -> None:
        self.paths += [path] * len(sent)


def test_a_hinted_row_goes_out_when_due_never_before(engine: Engine) -> None:
    """An in-process relay with a refresh far away: the commit's hint alone wakes it.
    The row is published after its deliver_at by the database clock (arrival on this
    host's wall clock plus the measured bound of the database's offset)."""
    far = Settings(sweep_interval_s=3600.0)
    broker, heard = MemoryBroker(), Published()
    relay = Relay(engine, broker, far, [heard], sweeper=False)
    relay.start()
    try:
        assert relay.scheduler is not None
        timing = relay.scheduler.timing  # its first claim, at start, planned the next far away:
        wait_until(lambda: timing.wake_at() > time.monotonic() + 60, 30, "the first claim")
        messages = schedule_rows(engine, "sch.hint", [0.8])
        relay.submit(messages)
        wait_until(lambda: broker.published, 30, "the hinted row")
    finally:
        relay.stop(10)
    offset = db_offset_bound_s(engine)
    assert early(arrivals(broker), due_times(engine), offset) == []
    assert heard.paths == ["scheduler"]
    late_s = arrivals(broker)[messages[0].msg_id] - due_times(engine)[messages[0].msg_id]
    print(f"late by {late_s.total_seconds() * 1000:.1f} ms (wall clock; offset bound {offset})")
    assert datetime.now(UTC) > due_times(engine)[messages[0].msg_id]


def test_drain_publishes_due_rows_and_counts_the_rest(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    name, prefix = stream
    with migrated(pg_url) as eng:
        due = schedule_rows(eng, f"{prefix}.d", [-2.0, -1.0, 0.0])
        later = schedule_rows(eng, f"{prefix}.d", [3600.0, 3600.0])
        broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
        done = subprocess.run(
            [OUTBOX, "drain", "--db", pg_url, "--broker", broker, "--json"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert (report["sent"], report["pending_at_start"], report["scheduled_later"]) == (3, 3, 2)
        now = statuses(eng)
    assert [now[m.msg_id] for m in due] == ["sent"] * 3
    assert [now[m.msg_id] for m in later] == ["pending"] * 2
