"""App factories and lifecycles (docs/concepts.md, App factories): an Outbox built at
import time and bound later (``ob.bind(engine)``), ``OUTBOX_START_RELAY=false`` and an
empty broker starting nothing, and a relay started before the tables exist saying so.

A bug would look like: an unbound Outbox writing somewhere or failing with an
AttributeError; a second pool beside the app's; a relay's threads started in a CLI
command; "database unreachable" for a database that answered "no such table".
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from outbox.errors import ConfigError
from outbox.secrets import url_of
from outbox.urls import with_driver
from relay.testing import MemoryBroker
from tests.helpers import migrated, unsent, wait_until

UNBOUND = r"^db: this Outbox is not bound to a database yet; call ob\.bind\(engine\)$"


def thread_ids() -> set[int | None]:
    return {t.ident for t in threading.enumerate()}


@pytest.fixture
def app_engine(db_url: str) -> Iterator[Engine]:
    """The app's own engine on a migrated database (PostgreSQL, SQLite)."""
    with migrated(db_url) as engine:
        yield engine


def test_an_outbox_built_before_its_engine_refuses_work_until_bound(
    app_engine: Engine,
) -> None:
    ob = Outbox(broker=MemoryBroker())  # at import time: no engine yet

    @ob.transactional  # decorating needs no database
    def place(session: Session, sku: str) -> str:
        return ob.send(session, "shop.placed", {"sku": sku})

    assert repr(ob) == "Outbox(db=None, broker='<MemoryBroker>')" and not ob.bound
    with (
        Session(app_engine) as session,
        session.begin(),
        pytest.raises(ConfigError, match=UNBOUND),
    ):
        ob.send(session, "shop.placed", {})
    for call in (ob.start, lambda: place("A-1"), lambda: ob.engine):
        with pytest.raises(ConfigError, match=UNBOUND):
            call()
    ob.stop()  # a fixture's teardown: nothing to stop
    assert unsent(app_engine.url.render_as_string(hide_password=False)) == 0


def test_bind_takes_the_apps_engine_and_its_one_pool(app_engine: Engine) -> None:
    broker = MemoryBroker()
    ob = Outbox(broker=broker)

    @ob.transactional
    def place(session: Session, sku: str) -> str:
        session.execute(text("SELECT 1"))
        return ob.send(session, "shop.placed", {"sku": sku})

    assert ob.bind(app_engine) is ob and ob.bound
    assert ob.engine is app_engine and ob.session_factory.kw["bind"] is app_engine
    assert ob.bind(app_engine) is ob  # the same engine again: nothing changes
    ob.start()
    try:
        msg_id = place("A-1")
        wait_until(lambda: broker.published, what="the message published")
    finally:
        ob.stop()
    assert [m.msg_id for m in broker.published] == [msg_id]
    assert repr(ob).startswith("Outbox(db='") and "<MemoryBroker>" in repr(ob)


def test_late_binding_of_an_async_engine(pg_url: str) -> None:
    broker = MemoryBroker()
    ob = Outbox(broker=broker)

    @ob.transactional
    async def place(session: AsyncSession, sku: str) -> str:
        return ob.send(session, "shop.placed", {"sku": sku})

    async def run() -> tuple[str, str]:
        app_engine = create_async_engine(with_driver(pg_url))  # psycopg's async side
        try:
            ob.bind(app_engine)
            assert ob.async_engine is app_engine  # the app's: its pool for async sessions
            ob.start()
            by_decorator = await place("A-1")
            async with AsyncSession(app_engine) as session, session.begin():
                by_session = ob.send(session, "shop.placed", {"sku": "B-2"})
            return by_decorator, by_session
        finally:
            await ob.stop_async()
            await app_engine.dispose()

    with migrated(pg_url):
        broker_ob = asyncio.run(run())
        assert unsent(pg_url) == 0
    assert sorted(m.msg_id for m in broker.published) == sorted(broker_ob)


def test_binding_again(app_engine: Engine, db_url: str, tmp_path: object) -> None:
    """A new engine (the next app a test suite builds), on the same database or a fresh
    one, moves the Outbox while no relay runs; a move while relaying is refused."""
    ob = Outbox(app_engine, broker=MemoryBroker())
    again = create_engine(app_engine.url)
    try:
        ob.bind(again)
        assert ob.engine is again
        ob.start()
        try:
            with pytest.raises(ConfigError, match=r"^db: this Outbox's relay is running on "):
                ob.bind(app_engine)
        finally:
            ob.stop()
        other = f"sqlite:///{tmp_path}/other.sqlite"
        ob.bind(other)
        assert str(ob.engine.url) == other
    finally:
        again.dispose()


def test_a_flask_app_factory_binds_the_module_level_outbox(sqlite_url: str) -> None:
    """Flask-SQLAlchemy's ``db.engine`` exists only in an app context: the factory binds."""
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    db = SQLAlchemy()
    ob = Outbox(broker="")  # what `Outbox(broker=os.environ.get("OUTBOX_BROKER"))` reads

    def create_app() -> Flask:
        app = Flask("shop")
        app.config["SQLALCHEMY_DATABASE_URI"] = sqlite_url
        db.init_app(app)
        with app.app_context():
            ob.bind(db.engine)
            ob.start()  # no relay: the broker is empty
        return app

    with migrated(sqlite_url):
        app = create_app()
        with app.app_context():
            assert ob.engine is db.engine  # one engine, one pool
            msg_id = ob.send(db.session, "shop.placed", {"sku": "A-1"})
            db.session.commit()
        assert ob.relay is None and unsent(sqlite_url) == 1, msg_id


def test_start_relay_false_starts_nothing(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OUTBOX_START_RELAY", "false")
    with migrated(sqlite_url):
        ob = Outbox(sqlite_url, broker=MemoryBroker())
        assert ob.settings.start_relay is False
        before = thread_ids()
        with caplog.at_level(logging.DEBUG):
            ob.start()
        assert thread_ids() <= before and ob.relay is None
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            ("INFO", "relay not started: start_relay is false (OUTBOX_START_RELAY)")
        ]
        with Session(ob.engine) as session, session.begin():
            ob.send(session, "shop.placed", {})  # sends still work: the row waits
        assert unsent(sqlite_url) == 1 and ob.handed_off == 0
        ob.stop()


def test_an_empty_broker_means_no_relay_and_none_raises_at_start(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    ob = Outbox(sqlite_url, broker="")
    assert ob.broker is None and ob.broker_url is None
    before = thread_ids()
    with caplog.at_level(logging.DEBUG):
        ob.start()
    assert thread_ids() <= before and ob.relay is None
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "relay not started: the broker is empty (OUTBOX_BROKER=''), no relay here")
    ]
    with pytest.raises(ConfigError, match=r"^broker: start\(\) needs a broker URL"):
        Outbox(sqlite_url).start()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mariadb"])
def test_a_relay_started_before_the_tables_says_so(
    kind: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """Not "database unreachable": the database answered that the table is missing. Once
    `outbox migrate` ran, the relay works without a restart."""
    url = str(request.getfixturevalue({"sqlite": "sqlite_url", "postgresql": "pg_url",
                                       "mariadb": "mariadb_url"}[kind]))  # fmt: skip
    broker = MemoryBroker()
    ob = Outbox(url, broker=broker, sweep_interval_s=0.05, sweeper_age_s=0.2,
                handoff_limit_s=0.1)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="relay"):
        ob.start()
        try:
            wait_until(lambda: "scheduler waiting" in caplog.text, what="the missing tables told")
            told = [(r.levelname, r.getMessage()) for r in caplog.records]
            # (a claim that meets the migration's DDL may fail as it would on any schema change)
            migrate.upgrade(url)
            with Session(ob.engine) as session, session.begin():
                msg_id = ob.send(session, "shop.placed", {})
            wait_until(lambda: broker.published, what="the message published once migrated")
        finally:
            ob.stop()
    assert [m.msg_id for m in broker.published] == [msg_id]
    assert not [m for _, m in told if "unreachable" in m]
    where = url_of(ob.engine)
    assert (
        "WARNING",
        f"scheduler waiting: no outbox tables in {where}: run `outbox migrate`",
    ) in told
    assert all("run `outbox migrate`" in m for _, m in told)
