"""Errors that name their cause (issue 36, item 6).

No outbox table: send() (or an AsyncSession's COMMIT, or an ordered message's) raises
``SchemaMissing`` naming ``outbox migrate``, the driver's error kept as ``__cause__``;
before, the driver's raw UndefinedTable / "no such table" / 1146 came out. A sync send()
flushes the app's pending changes first (SQLAlchemy's autoflush): an error of the app's
own rows comes out as the app's, raised by that flush before the outbox's INSERT starts.
"""

from __future__ import annotations

import asyncio
import traceback
from typing import Any

import pytest
from sqlalchemy import String, create_engine, make_url, text
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from outbox import Outbox, migrate
from outbox.engines import async_engine_from
from outbox.errors import OutboxError, SchemaMissing
from tests.flavours import ASYNC_DRIVERS

SENDS: dict[str, dict[str, Any]] = {
    "plain": {},
    "scheduled": {"delay": 60},
    "ordered": {"key": "k", "ordered": True},  # staged: written at COMMIT
}


class Base(DeclarativeBase):
    pass


class Item(Base):
    """An app's own table, with a rule its rows can break."""

    __tablename__ = "app_item"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(40), unique=True)


def assert_names_outbox_migrate(error: BaseException) -> None:
    assert isinstance(error, SchemaMissing)
    assert "run `outbox migrate`" in str(error) and "outbox_" in str(error)
    assert isinstance(error.__cause__, DBAPIError)  # the driver's own error, kept


@pytest.mark.parametrize("kind", list(SENDS))
def test_send_without_the_outbox_tables_names_outbox_migrate(any_db: str, kind: str) -> None:
    engine = create_engine(any_db)
    ob = Outbox(engine)
    try:
        with Session(engine) as session:
            with pytest.raises(SchemaMissing) as raised:
                ob.send(session, "app.created", {"n": 1}, **SENDS[kind])
                session.commit()  # an ordered message is written here
            assert_names_outbox_migrate(raised.value)
            session.rollback()
            assert session.execute(text("SELECT 1")).scalar() == 1  # the session goes on
    finally:
        engine.dispose()


@pytest.mark.parametrize("driver", list(ASYNC_DRIVERS))
def test_an_async_commit_without_the_outbox_tables_names_outbox_migrate(
    driver: str, request: pytest.FixtureRequest
) -> None:
    """The staged row is written just before COMMIT: the COMMIT raises it."""
    backend = ASYNC_DRIVERS[driver].split("+")[0]
    fixture = {"postgresql": "pg_url", "sqlite": "sqlite_url", "mysql": "mariadb_url"}[backend]
    url = make_url(str(request.getfixturevalue(fixture))).set(drivername=ASYNC_DRIVERS[driver])
    engine = async_engine_from(url.render_as_string(hide_password=False))
    ob = Outbox(engine)

    async def case() -> BaseException:
        try:
            async with AsyncSession(engine) as session:
                ob.send(session, "app.created", {"n": 1})
                with pytest.raises(SchemaMissing) as raised:
                    await session.commit()
                return raised.value
        finally:
            await engine.dispose()

    assert_names_outbox_migrate(asyncio.run(case()))
    ob.stop()


def test_an_apps_missing_table_is_not_the_outboxs(any_db: str) -> None:
    """The app's own table missing, the outbox's there: the app's error, as it is."""
    migrate.upgrade(any_db)
    engine = create_engine(any_db)
    ob = Outbox(engine)
    try:
        with Session(engine) as session:
            session.add(Item(id=1, name="a"))  # app_item was never created
            with pytest.raises(DBAPIError) as raised:
                ob.send(session, "app.created", {"n": 1})
            assert not isinstance(raised.value, OutboxError)
            assert "app_item" in str(raised.value)
    finally:
        engine.dispose()


def outbox_insert_started(error: BaseException) -> bool:
    """Did the error come out of the outbox's own write (rows.write), not before it?"""
    return any(
        frame.filename.endswith("outbox/rows.py") and frame.name in ("write", "_write")
        for frame in traceback.extract_tb(error.__traceback__)
    )


def app_with_one_item(url: str) -> Any:
    migrate.upgrade(url)
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    with Session(engine) as session, session.begin():
        session.add(Item(id=1, name="taken"))
    return engine


def test_the_apps_own_flush_error_comes_from_its_flush(any_db: str) -> None:
    """send() flushes the app's pending rows first; a row that breaks the app's unique rule
    raises the app's IntegrityError from that flush, before the outbox's INSERT (it came
    from inside it: Session.execute(INSERT) autoflushed)."""
    engine = app_with_one_item(any_db)
    ob = Outbox(engine)
    try:
        with Session(engine) as session:
            session.add(Item(id=2, name="taken"))
            with pytest.raises(IntegrityError) as raised:
                ob.send(session, "app.created", {"n": 2})
            assert not isinstance(raised.value, OutboxError)
            assert "app_item" in str(raised.value.statement)
            assert not outbox_insert_started(raised.value)
    finally:
        engine.dispose()


def test_no_autoflush_keeps_send_from_flushing(db_url: str) -> None:
    """``session.no_autoflush`` holds for send() as for a query: the app's bad row is
    flushed at its COMMIT, and the outbox's row is written meanwhile."""
    engine = app_with_one_item(db_url)
    ob = Outbox(engine)
    try:
        with Session(engine) as session:
            session.add(Item(id=2, name="taken"))
            with session.no_autoflush:
                ob.send(session, "app.created", {"n": 2})
            with pytest.raises(IntegrityError):
                session.commit()
        assert ob.committed == 0
    finally:
        engine.dispose()


def test_an_async_apps_flush_error_at_commit_is_the_apps(sqlite_url: str) -> None:
    """AsyncSession: the staged row is written at COMMIT, after the app's rows are flushed:
    their error is the app's IntegrityError."""
    app_with_one_item(sqlite_url).dispose()
    engine = async_engine_from(sqlite_url.replace("sqlite://", "sqlite+aiosqlite://"))
    ob = Outbox(engine)

    async def case() -> BaseException:
        try:
            async with AsyncSession(engine) as session:
                session.add(Item(id=2, name="taken"))
                ob.send(session, "app.created", {"n": 2})
                with pytest.raises(IntegrityError) as raised:
                    await session.commit()
                return raised.value
        finally:
            await engine.dispose()

    error = asyncio.run(case())
    assert not isinstance(error, OutboxError) and not outbox_insert_started(error)
    assert ob.committed == 0
    ob.stop()
