"""One clock: apps and relays whose sessions are in different time zones agree on every age.

Each app engine runs ``SET time_zone`` (MariaDB) or ``SET TIME ZONE`` (PostgreSQL) on every
pooled connection; the relay's own engine is in UTC or in another zone. Before the fix, a
MariaDB app in +01:00 had its crashed messages recovered an hour late, and one in -01:00
had fresh rows swept at once, racing the fast path.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import redirect_stdout
from datetime import UTC, datetime, timedelta
from io import StringIO
from typing import Any
from urllib.parse import quote

import pytest
from sqlalchemy import Engine, create_engine, event, select, text
from sqlalchemy.orm import Session

from outbox import Outbox, migrate, outbox_message
from outbox.events import Path, RelayListener, Sent
from outbox.settings import Settings
from relay import store
from relay.brokers import broker_for
from relay.brokers.nats import read_stream
from relay.cli import main as cli
from relay.loop import BrokerLoop
from relay.sweep.sweeper import Sweeper
from relay.testing.embedded import NatsServer
from tests.helpers import running, wait_until

t = outbox_message
AGE_S = 2.0  # the crash case's sweeper age: short, so each case takes seconds
INTERVAL_S = 0.5
LOAD_SLACK_S = 30.0  # a busy machine may run a sweep late; the bug was an hour late
N = 20
# (app's zone, relay's zone): each app zone against a UTC relay, and the widest spread.
ZONES = [("+01:00", "+00:00"), ("-01:00", "+00:00"), ("+14:00", "+00:00"), ("-01:00", "+14:00")]


def settable(zone: str, dialect: str) -> str:
    """MariaDB takes offsets up to +13:00 only (+14:00, Kiribati, needs its zone tables)."""
    return "+13:00" if dialect == "mysql" and zone == "+14:00" else zone


def zoned(url: str, zone: str, **kw: Any) -> Engine:
    """An engine whose every pooled connection is in ``zone`` (an offset like -01:00)."""
    assert re.fullmatch(r"[+-]\d\d:\d\d", zone), zone  # a constant of this module, never input
    engine = create_engine(url, **kw)
    zone = settable(zone, engine.dialect.name)
    set_zone = (
        f"SET time_zone = '{zone}'"
        if engine.dialect.name == "mysql"
        else f"SET TIME ZONE INTERVAL '{zone}' HOUR TO MINUTE"  # ISO sign, unlike 'UTC+1'
    )

    @event.listens_for(engine, "connect")
    def in_zone(dbapi_conn: Any, record: object) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute(set_zone)
        cursor.close()
        dbapi_conn.commit()  # PostgreSQL: a SET inside the pool's first rollback would be undone

    return engine


def session_offset(engine: Engine) -> timedelta:
    """How far the session's local clock is from UTC: proves the zone took effect."""
    with engine.connect() as conn:
        if engine.dialect.name == "mysql":
            sql = "SELECT TIMESTAMPDIFF(MINUTE, UTC_TIMESTAMP(), NOW())"
        else:
            sql = "SELECT (EXTRACT(TIMEZONE FROM now()) / 60)::int"
        return timedelta(minutes=conn.execute(text(sql)).scalar_one())


def offset_of(zone: str) -> timedelta:
    sign = -1 if zone.startswith("-") else 1
    hours, minutes = zone[1:].split(":")
    return sign * timedelta(hours=int(hours), minutes=int(minutes))


class Deliveries(RelayListener):
    """When (monotonic) each message was published, and by which path."""

    def __init__(self) -> None:
        self.at: dict[str, tuple[float, Path]] = {}
        self._lock = threading.Lock()

    def published(self, sent: Sequence[Sent], path: Path) -> None:
        now = time.monotonic()
        with self._lock:
            for s in sent:
                self.at.setdefault(s.msg_id, (now, path))

    def by(self, path: Path) -> set[str]:
        with self._lock:
            return {m for m, (_, p) in self.at.items() if p == path}


@pytest.fixture(params=["mariadb", "postgresql"])
def db(request: pytest.FixtureRequest) -> str:
    url = str(request.getfixturevalue("mariadb_url" if request.param == "mariadb" else "pg_url"))
    migrate.upgrade(url)
    return url


@pytest.fixture
def broker_url(nats_server: NatsServer, stream: tuple[str, str]) -> str:
    name, prefix = stream
    return f"{nats_server.url}?stream={name}&subjects={prefix}.>"


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.dispose()


@pytest.fixture
def outboxes() -> Iterator[list[Outbox]]:
    started: list[Outbox] = []
    yield started
    for ob in started:
        ob.stop(timeout=5)


def engines_in(db: str, app_zone: str, relay_zone: str, made: list[Engine]) -> tuple[Engine, ...]:
    app, relay = zoned(db, app_zone), zoned(db, relay_zone)
    made += [app, relay]
    for engine, zone in ((app, app_zone), (relay, relay_zone)):
        assert session_offset(engine) == offset_of(settable(zone, engine.dialect.name))
    return app, relay


def commit(ob: Outbox, engine: Engine, topic: str, n: int, per_tx: int = 5) -> list[str]:
    ids: list[str] = []
    for start in range(0, n, per_tx):
        with Session(engine) as session, session.begin():
            ids += [ob.send(session, topic, {"n": i}) for i in range(start, start + per_tx)]
    return ids


@pytest.mark.parametrize(("app_zone", "relay_zone"), ZONES)
def test_a_crashed_apps_messages_are_recovered_at_the_sweeper_age(
    db: str,
    broker_url: str,
    stream: tuple[str, str],
    nats_server: NatsServer,
    app_zone: str,
    relay_zone: str,
    engines: list[Engine],
    outboxes: list[Outbox],
) -> None:
    """The app commits and never hands off (no relay in it: a crash); a relay elsewhere
    sweeps them once they are ``sweeper_age_s`` old on the database clock, not before."""
    app, relay_engine = engines_in(db, app_zone, relay_zone, engines)
    deliveries = Deliveries()
    relay = Outbox(
        relay_engine, broker_url, listener=deliveries,
        sweeper_age_s=AGE_S, handoff_limit_s=AGE_S / 2, sweep_interval_s=INTERVAL_S,
    )  # fmt: skip
    relay.start()
    outboxes.append(relay)
    crashed = Outbox(app)  # broker=None: nothing in this process publishes

    before = time.monotonic()
    ids = commit(crashed, app, f"{stream[1]}.clock", N)
    wait_until(
        lambda: deliveries.by("sweeper") >= set(ids),
        timeout=AGE_S + INTERVAL_S + LOAD_SLACK_S,
        what="the sweeper to recover every committed message",
    )
    early = {m: round(deliveries.at[m][0] - before, 3) for m in ids}
    assert all(s >= AGE_S - 0.05 for s in early.values()), f"swept before {AGE_S} s: {early}"
    with relay_engine.connect() as conn:  # the same, on the database's own clock
        rows = conn.execute(select(t.c.created_at, t.c.sent_at)).all()
    assert len(rows) == N
    assert all(sent - created >= timedelta(seconds=AGE_S) for created, sent in rows), rows
    published = asyncio.run(read_stream(nats_server.url, stream[0]))
    assert sorted(str(m.msg_id) for m in published) == sorted(ids)


@pytest.mark.parametrize(("app_zone", "relay_zone"), ZONES)
def test_a_healthy_fast_path_is_never_raced_by_a_sweeper(
    db: str,
    broker_url: str,
    stream: tuple[str, str],
    app_zone: str,
    relay_zone: str,
    engines: list[Engine],
    outboxes: list[Outbox],
) -> None:
    """The app publishes by its fast path; the sweepers in it and in a relay elsewhere
    sweep every 0.1 s and must take none of those fresh rows: no second copy."""
    app, relay_engine = engines_in(db, app_zone, relay_zone, engines)
    deliveries = Deliveries()
    # A long age: the fast path has 30 s to mark its rows, whatever the load. Before the
    # fix a -01:00 app's rows looked an hour old the moment they were written.
    options: dict[str, Any] = {"sweeper_age_s": 30.0, "sweep_interval_s": 0.1}
    ob = Outbox(app, broker_url, listener=deliveries, **options)
    other = Outbox(relay_engine, broker_url, listener=deliveries, **options)
    for started in (ob, other):
        started.start()
        outboxes.append(started)

    ids = commit(ob, app, f"{stream[1]}.clock", N)
    wait_until(lambda: deliveries.by("fast") >= set(ids), timeout=60, what="the fast path")
    assert deliveries.by("sweeper") == set()
    with relay_engine.connect() as conn:
        statuses = conn.execute(select(t.c.status)).scalars().all()
    assert statuses == ["sent"] * N


@pytest.mark.parametrize(("app_zone", "relay_zone"), ZONES)
def test_a_sweeper_takes_a_row_at_its_age_and_not_before(
    db: str,
    broker_url: str,
    stream: tuple[str, str],
    app_zone: str,
    relay_zone: str,
    engines: list[Engine],
    loops: list[BrokerLoop],
) -> None:
    """The age comparison itself, with no timing: a fresh row is younger than 60 s and
    older than 0 s, whichever zones wrote and read it."""
    app, relay_engine = engines_in(db, app_zone, relay_zone, engines)
    ids = commit(Outbox(app), app, f"{stream[1]}.clock", 3, per_tx=3)
    sweeper = Sweeper(relay_engine, running(broker_for(broker_url), loops), Settings())
    assert sweeper.sweep_once(min_age_s=60).claimed == 0, "a fresh row looked a minute old"
    assert sweeper.sweep_once(min_age_s=0).claimed == len(ids), "a fresh row looked unborn"


@pytest.mark.parametrize(("app_zone", "relay_zone"), ZONES)
def test_retention_counts_from_sent_at_on_one_clock(
    db: str,
    broker_url: str,
    stream: tuple[str, str],
    app_zone: str,
    relay_zone: str,
    engines: list[Engine],
    loops: list[BrokerLoop],
) -> None:
    """Rows marked sent by a session in one zone, purged by a relay in another: kept for
    the retention period (1 h here), deleted past it."""
    app, relay_engine = engines_in(db, app_zone, relay_zone, engines)
    ids = commit(Outbox(app), app, f"{stream[1]}.clock", 3, per_tx=3)
    with app.begin() as conn:  # marked by the app's session, as the fast path's acks are
        store.finish(conn, [(m, "r") for m in ids], "keep")
    sweeper = Sweeper(
        relay_engine, running(broker_for(broker_url), loops), Settings(retention_s=3600)
    )
    assert sweeper.purge() == 0, "rows sent just now were purged"
    two_hours = "INTERVAL 2 HOUR" if app.dialect.name == "mysql" else "interval '2 hours'"
    with app.begin() as conn:
        conn.execute(text(f"UPDATE outbox_message SET sent_at = sent_at - {two_hours}"))
    assert sweeper.purge() == len(ids)


@pytest.mark.parametrize("zone", ["+14:00", "-01:00"])
def test_outbox_status_oldest_age_under_a_session_zone(
    mariadb_url: str, zone: str, engines: list[Engine]
) -> None:
    """`outbox status` on a MariaDB connection in another zone than the app's writer."""
    migrate.upgrade(mariadb_url)
    app = zoned(mariadb_url, "-01:00" if zone == "+14:00" else "+14:00")
    engines.append(app)
    commit(Outbox(app), app, "st.clock", 2, per_tx=2)
    init = quote(f"SET time_zone = '{settable(zone, 'mysql')}'")
    out = StringIO()
    with redirect_stdout(out):
        cli(["status", "--json", "--db", f"{mariadb_url}?init_command={init}"])
    total = json.loads(out.getvalue())["total"]
    assert total["pending"] == 2
    assert 0 <= total["oldest_pending_age_s"] < LOAD_SLACK_S, total


@pytest.mark.parametrize("zone", ["+05:00", "-05:00"])
def test_a_naive_time_bound_to_a_time_column_is_utc(
    db: str, zone: str, stream: tuple[str, str], engines: list[Engine]
) -> None:
    """A naive datetime compared with created_at means UTC on every backend: a bug would
    have PostgreSQL read it in the session's zone, five hours off here."""
    app = zoned(db, zone)
    engines.append(app)
    ids = commit(Outbox(app), app, f"{stream[1]}.clock", 1, per_tx=1)
    now = datetime.now(UTC).replace(tzinfo=None)
    t = outbox_message
    window = (t.c.created_at > now - timedelta(minutes=1)) & (
        t.c.created_at < now + timedelta(minutes=1)
    )
    with app.connect() as conn:
        found = conn.execute(select(t.c.msg_id).where(window)).scalars().all()
    assert [str(m) for m in found] == ids
