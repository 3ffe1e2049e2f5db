"""Any delay send() accepts gives deliver_at = the INSERT's time on the database clock plus
the delay: never earlier, and later only by the clock's rounding (a microsecond; a
millisecond on SQLite, whose clock counts milliseconds)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Engine, create_engine, select
from sqlalchemy.orm import Session

from outbox import Outbox, migrate, outbox_message
from outbox.errors import OutboxError
from outbox.message import MAX_DELAY_S
from outbox.table import db_now
from relay.testing import scratch_schema
from tests.conftest import PG_URL, scratch_mariadb
from tests.property.strategies import PROPERTY

t = outbox_message
US = timedelta(microseconds=1)
delays = st.one_of(
    st.floats(min_value=0, max_value=MAX_DELAY_S),
    st.floats(min_value=0, max_value=5),
    st.integers(min_value=0, max_value=MAX_DELAY_S),
    st.timedeltas(min_value=timedelta(0), max_value=timedelta(seconds=MAX_DELAY_S)),
)


@pytest.fixture(scope="module", params=["postgresql", "mariadb", "sqlite"])
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """A migrated database of this module's own: hypothesis runs many examples per test."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path_factory.mktemp('delay') / Path('outbox.sqlite')}"
        elif request.param == "postgresql":
            url = stack.enter_context(scratch_schema(PG_URL, "dl"))
        else:
            url = stack.enter_context(scratch_mariadb("dl"))
        eng = create_engine(url)
        migrate.upgrade(eng)
        yield eng
        eng.dispose()


def exact_micros(delay: float | int | timedelta) -> Fraction:
    """The delay as the app meant it, in microseconds, with no rounding at all."""
    if isinstance(delay, timedelta):
        return Fraction(delay // US)
    return Fraction(delay) * 1_000_000


@PROPERTY
@given(delay=delays)
def test_a_delay_counts_from_the_insert_on_the_database_clock(
    engine: Engine, delay: float | int | timedelta
) -> None:
    ob = Outbox(engine)
    with Session(engine) as session, session.begin():
        before: datetime = session.execute(select(db_now())).scalar_one()
        msg_id = ob.send(session, "delayed", b"x", delay=delay)
        after: datetime = session.execute(select(db_now())).scalar_one()
    with engine.connect() as conn:
        query = select(t.c.created_at, t.c.deliver_at).where(t.c.msg_id == uuid.UUID(msg_id))
        created_at, deliver_at = conn.execute(query).one()
    wanted = exact_micros(delay)
    unit = 1000 if engine.dialect.name == "sqlite" else 1
    gap = (deliver_at - created_at) // US
    # Never early (a nanosecond of float noise aside), late by less than the clock's unit
    # (plus one microsecond where a timedelta became float seconds).
    assert wanted - Fraction(1, 1000) <= gap < wanted + unit + 1
    # created_at is the INSERT's time: between two reads of the database clock around it.
    assert before <= created_at <= after


anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.timedeltas(),
    st.datetimes(),
    st.datetimes(timezones=st.timezones()),
    st.dates(),
    st.builds(object),
    st.lists(st.integers(), max_size=2),
)


@PROPERTY
@given(delay=anything, deliver_at=anything, delay_level=anything, dedup_key=anything)
def test_any_schedule_gives_a_msg_id_or_an_outbox_error(
    engine: Engine, delay: object, deliver_at: object, delay_level: object, dedup_key: object
) -> None:
    """Whatever the four arguments hold: a stored row or an OutboxError, and the
    transaction still usable; a stored row has a due time iff any of them was given."""
    ob = Outbox(engine)
    kw = {"delay": delay, "deliver_at": deliver_at, "delay_level": delay_level,
          "dedup_key": dedup_key}  # fmt: skip
    with Session(engine) as session, session.begin():
        try:
            msg_id: str | None = ob.send(session, "any.schedule", b"x", **kw)  # type: ignore[arg-type]
        except OutboxError:
            msg_id = None
        after = ob.send(session, "after.refusal", b"ok")
    with engine.connect() as conn:
        query = select(t.c.msg_id, t.c.deliver_at).where(
            t.c.msg_id.in_([uuid.UUID(m) for m in (msg_id, after) if m is not None])
        )
        due = {str(r.msg_id): r.deliver_at for r in conn.execute(query)}
    assert due[after] is None
    if msg_id is not None:
        asked = any(v is not None for v in kw.values())
        assert (due[msg_id] is not None) == asked
