"""send(delay=..., deliver_at=..., delay_level=..., dedup_key=...): the row and its due time.

The due time is the database's: ``deliver_at`` is computed in the INSERT from the same
clock that writes ``created_at`` (no app clock involved), whatever the session's time
zone. A dedup_key makes the msg_id, and a second send of it writes nothing.
"""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, func, select, text
from sqlalchemy.orm import Session

from outbox import Outbox, outbox_message
from outbox.errors import InvalidSchedule
from outbox.table import db_now
from tests.flavours import Flavour, maybe
from tests.helpers import migrated
from tests.locks import blocked_on_lock

t = outbox_message
FUTURE = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
PAST = datetime(2001, 2, 3, 4, 5, 6, 654321, tzinfo=UTC)


def row(engine: Engine, msg_id: str) -> Any:
    with engine.connect() as conn:
        query = select(t).where(t.c.msg_id == uuid.UUID(msg_id))
        return conn.execute(query).one()


def count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(t)).scalar_one())


def gap(engine: Engine, delay_s: float) -> timedelta:
    """deliver_at - created_at for a delay: exact microseconds, milliseconds on SQLite
    (its clock's unit), rounded up."""
    if engine.dialect.name == "sqlite":
        return timedelta(milliseconds=math.ceil(delay_s * 1000))
    return timedelta(microseconds=math.ceil(delay_s * 1_000_000))


def test_a_refused_schedule_writes_nothing_and_keeps_the_transaction(any_db: str) -> None:
    with migrated(any_db) as engine:
        ob = Outbox(engine)
        bad: list[dict[str, Any]] = [
            {"delay": -1},
            {"delay": True},
            {"deliver_at": datetime(2030, 1, 1)},
            {"delay": 5, "deliver_at": FUTURE},
            {"delay_level": 19},
            {"dedup_key": ""},
            {"dedup_key": "k", "key": "a", "ordered": True},
        ]
        with Session(engine) as session, session.begin():
            for kw in bad:
                with pytest.raises(InvalidSchedule):
                    ob.send(session, "orders", b"x", **kw)
            after = ob.send(session, "orders", b"ok", delay=1)
        assert count(engine) == 1
        assert row(engine, after).payload == b"ok"


def test_due_times_come_from_the_database_clock(flavour: Flavour) -> None:
    """Delays count from the INSERT on the database clock (created_at's); a deliver_at is
    stored as given, a past one too; unscheduled, ordered and scheduled messages of one
    transaction are written side by side (an AsyncSession's in one go at COMMIT)."""
    ob, engine = flavour.ob, flavour.engine
    sent: dict[str, str] = {}

    async def case() -> None:
        session = flavour.session()
        try:
            sent["td"] = ob.send(session, "a", b"1", delay=timedelta(minutes=90, microseconds=7))
            sent["float"] = ob.send(session, "a", b"2", delay=2.5)
            sent["zero"] = ob.send(session, "a", b"3", delay=0)
            sent["level"] = ob.send(session, "a", b"4", delay_level=3)
            sent["future"] = ob.send(session, "a", b"5", deliver_at=FUTURE)
            sent["past"] = ob.send(session, "a", b"6", deliver_at=PAST)
            sent["now"] = ob.send(session, "a", b"7")
            sent["ordered"] = ob.send(session, "a", b"8", key="k", ordered=True)
            await maybe(session.commit())
        finally:
            await maybe(session.close())

    flavour.run(case)
    rows = {name: row(engine, msg_id) for name, msg_id in sent.items()}
    delays = {"td": 5400.000007, "float": 2.5, "zero": 0.0, "level": 10.0}
    for name, delay_s in delays.items():
        r = rows[name]
        assert r.deliver_at - r.created_at == gap(engine, delay_s), name
    assert (rows["future"].deliver_at, rows["past"].deliver_at) == (FUTURE, PAST)
    assert rows["now"].deliver_at is None and rows["ordered"].deliver_at is None
    assert rows["ordered"].seq == 1
    assert {r.status for r in rows.values()} == {"pending"}


def zoned(url: str, zone: str) -> Engine:
    """An engine whose every connection's session time zone is ``zone`` (+05:00 ...)."""
    engine = create_engine(url)
    set_zone = (
        f"SET time_zone = '{zone}'"
        if engine.dialect.name == "mysql"
        else f"SET TIME ZONE INTERVAL '{zone}' HOUR TO MINUTE"
    )

    @event.listens_for(engine, "connect")
    def in_zone(dbapi_conn: Any, record: object) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute(set_zone)
        cursor.close()
        dbapi_conn.commit()

    return engine


def db_clock(engine: Engine) -> datetime:
    with engine.connect() as conn:
        return conn.execute(select(db_now())).scalar_one()  # type: ignore[no-any-return]


@pytest.mark.parametrize("zone", ["+05:00", "-09:30"])
def test_the_due_time_ignores_the_session_time_zone(server_db: Engine, zone: str) -> None:
    """A sender whose session runs in another zone schedules by the same UTC clock: the
    due time sits between two reads of db_now() (UTC) around the send, plus the delay."""
    app = zoned(server_db.url.render_as_string(hide_password=False), zone)
    try:
        ob = Outbox(app)
        with app.connect() as conn:  # the zone took effect: local time is not UTC
            local = "NOW()" if app.dialect.name == "mysql" else "LOCALTIMESTAMP"
            shown = conn.execute(text(f"SELECT {local}")).scalar_one()
            assert abs(shown - datetime.now(UTC).replace(tzinfo=None)) > timedelta(hours=4)
        at_in_zone = FUTURE.astimezone(timezone(timedelta(hours=5)))
        before = db_clock(server_db)
        with Session(app) as session, session.begin():
            delayed = ob.send(session, "a", b"x", delay=60)
            fixed = ob.send(session, "a", b"y", deliver_at=at_in_zone)
        after = db_clock(server_db)
    finally:
        app.dispose()
    due = row(server_db, delayed).deliver_at
    assert before + timedelta(seconds=60) <= due <= after + timedelta(seconds=60)
    assert row(server_db, fixed).deliver_at == FUTURE


def test_a_dedup_key_writes_once(flavour: Flavour) -> None:
    """Twice in one transaction (an AsyncSession's both in its one INSERT), then again in a
    second transaction: one row, the first payload, the same msg_id every time."""
    ob, engine = flavour.ob, flavour.engine
    ids: list[str] = []

    async def send(*payloads: bytes, topic: str = "reminders") -> None:
        session = flavour.session()
        try:
            for payload in payloads:
                ids.append(ob.send(session, topic, payload, dedup_key="order-42", delay=30))
            await maybe(session.commit())
        finally:
            await maybe(session.close())

    async def case() -> None:
        await send(b"first", b"second")
        await send(b"third")
        await send(b"other", topic="reminders.other")

    flavour.run(case)
    assert ids[0] == ids[1] == ids[2] != ids[3]
    assert count(engine) == 2
    assert row(engine, ids[0]).payload == b"first"
    assert row(engine, ids[3]).payload == b"other"


@pytest.mark.parametrize("first_commits", [True, False])
def test_a_concurrent_dedup_waits_then_writes_nothing(
    server_db: Engine, first_commits: bool
) -> None:
    """Two connections send one (topic, dedup_key): the second INSERT waits on the unique
    index for the first transaction, then does nothing (no error) if it committed, or
    writes its own row if it rolled back."""
    ob = Outbox(server_db)
    with Session(server_db) as first:
        first.begin()
        msg_id = ob.send(first, "r", b"first", dedup_key="k", delay=60)
        with blocked_on_lock(
            server_db,
            lambda session: ob.send(session, "r", b"second", dedup_key="k", delay=60),
            "the second INSERT waiting on the first transaction",
        ) as second:
            first.commit() if first_commits else first.rollback()
    assert second["value"] == msg_id
    assert count(server_db) == 1
    assert row(server_db, msg_id).payload == (b"first" if first_commits else b"second")
