"""A message whose transaction rolled back is never published, whatever the engine.

Two setups published one (issue 36): an app engine with one shared connection
(StaticPool, Flask-SQLAlchemy's test default), whose relay threads committed the app's
open transaction under it, and a session in AUTOCOMMIT, where send()'s INSERT committed
at once. Now the relay never uses a connection of the app's (a pool of its own, or a
ConfigError at start()), and send() refuses an autocommitting session before it writes.

Each test proves the negative the same way: the relay had its chance while the app's
transaction was open (``RelayTransactions``), then a witness row that only the sweeper
can publish is published, and nothing else is. A bug shows as the rolled-back topic in
the broker, or its row left in the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, event, select, text
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool, SingletonThreadPool, StaticPool

from outbox import Outbox, migrate, outbox_message, rows
from outbox.engines import async_url, relay_engine
from outbox.errors import ConfigError, NotTransactional
from outbox.message import build_message
from outbox.table import PENDING
from relay.testing import MemoryBroker
from tests.helpers import count_rows, wait_until

# The sweeper takes a row 0.2 s old, every 0.05 s: the relay is busy with the table.
QUICK: dict[str, Any] = {"sweep_interval_s": 0.05, "sweeper_age_s": 0.2, "handoff_limit_s": 0.1}
ROLLED_BACK = "app.rolled_back"
# Each round gives the relay its chance: on the app's connection, its next statement either
# committed the app's transaction (the bug) or rolled it back (a pool's reset): one round
# could miss the bug, five do not in practice.
ROUNDS = 5
WITNESS = "app.witness"


class RelayTransactions:
    """Counts the transactions that ended (COMMIT or ROLLBACK) on other threads than the
    test's: the relay's. A relay on the app's connection ends the app's transaction too."""

    def __init__(self) -> None:
        self.ended = 0
        self._test_thread = threading.get_ident()
        self._lock = threading.Lock()

    def __enter__(self) -> RelayTransactions:
        event.listen(Engine, "commit", self._end)
        event.listen(Engine, "rollback", self._end)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(Engine, "commit", self._end)
        event.remove(Engine, "rollback", self._end)

    def _end(self, conn: Connection) -> None:
        if threading.get_ident() != self._test_thread:
            with self._lock:
                self.ended += 1

    def wait_for_more(self, n: int = 3) -> None:
        """Until ``n`` more relay transactions ended (they run every few tens of ms)."""
        seen = self.ended
        wait_until(lambda: self.ended >= seen + n, what=f"{n} transactions of the relay")


def witness(url: str) -> str:
    """Commit a row that no Session wrote, so that only the sweeper can publish it (the fast
    path never hears of it); once it is published, the sweeper has taken every row that
    committed before it. Its msg_id."""
    message = build_message(WITNESS, {}, max_payload_bytes=1000)
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            rows.write(conn, [message])
    finally:
        engine.dispose()
    return message.msg_id


def assert_only_the_witness_is_published(url: str, broker: MemoryBroker) -> None:
    msg_id = witness(url)
    wait_until(lambda: msg_id in [m.msg_id for m in broker.published], what="the witness")
    assert [m.topic for m in broker.published] == [WITNESS]
    assert count_rows(url, outbox_message.c.topic == ROLLED_BACK) == 0


@contextlib.contextmanager
def relay_on(
    engine: Engine | AsyncEngine, url: str, relay_first: bool, tables_by: str | Engine = ""
) -> Iterator[Outbox]:
    """An Outbox on ``engine`` with a MemoryBroker relay, started before the outbox's
    tables exist (``relay_first``) or after; stopped at the end. The tables are made
    through ``tables_by`` (by default a connection of their own)."""
    ob = Outbox(engine, MemoryBroker(), **QUICK)
    try:
        if relay_first:
            ob.start()
        migrate.upgrade(tables_by or url)
        if not relay_first:
            ob.start()
        yield ob
    finally:
        ob.stop()


def memory_broker(ob: Outbox) -> MemoryBroker:
    assert isinstance(ob.broker, MemoryBroker)
    return ob.broker


# --- One shared connection (StaticPool) ----------------------------------------------


@pytest.mark.parametrize("relay_first", [True, False], ids=["relay-first", "tables-first"])
@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_an_app_on_one_shared_connection_never_publishes_a_rolled_back_message(
    db: str, relay_first: bool, request: pytest.FixtureRequest
) -> None:
    """The app's one connection (StaticPool) on a database file or server: the relay gets
    an engine of its own. The bug: the relay's COMMIT on the app's connection committed the
    open transaction, and the sweeper published the row the app then rolled back."""
    url = str(request.getfixturevalue("sqlite_url" if db == "sqlite" else "pg_url"))
    # SQLite: the relay's own connections wait at most 0.2 s for the app's write lock.
    args = {"check_same_thread": False, "timeout": 0.2} if db == "sqlite" else {}
    engine = create_engine(url, poolclass=StaticPool, connect_args=args)
    try:
        with relay_on(engine, url, relay_first, tables_by=engine) as ob:  # as create_all()
            with RelayTransactions() as relay, Session(engine) as session:
                for n in range(ROUNDS):
                    ob.send(session, ROLLED_BACK, {"n": n})
                    relay.wait_for_more()
                    session.rollback()
            assert_only_the_witness_is_published(url, memory_broker(ob))
            assert ob.relay is not None and ob.relay.engine.pool is not engine.pool
    finally:
        engine.dispose()


@pytest.mark.parametrize("relay_first", [True, False], ids=["relay-first", "tables-first"])
def test_an_async_app_on_one_shared_connection_never_publishes_a_rolled_back_message(
    sqlite_url: str, relay_first: bool
) -> None:
    """aiosqlite under StaticPool: the relay's sync engine is its own (an async engine's
    connection cannot serve another thread), and the staged row is never written."""
    engine = create_async_engine(sqlite_url.replace("sqlite://", "sqlite+aiosqlite://"),
                                 poolclass=StaticPool)  # fmt: skip

    async def case(ob: Outbox) -> None:
        with RelayTransactions() as relay:
            async with AsyncSession(engine) as session:
                await session.execute(text("SELECT 1"))  # the app's transaction is open
                ob.send(session, ROLLED_BACK, {"n": 1})
                await asyncio.to_thread(relay.wait_for_more)
                await session.rollback()
        await engine.dispose()

    with relay_on(engine, sqlite_url, relay_first) as ob:
        asyncio.run(case(ob))
        assert_only_the_witness_is_published(sqlite_url, memory_broker(ob))


def sqlite_memory(pool: type) -> Engine:
    return create_engine("sqlite://", poolclass=pool, connect_args={"check_same_thread": False})


@pytest.mark.parametrize("pool", [StaticPool, SingletonThreadPool])
def test_a_relay_on_in_memory_sqlite_is_refused_at_start(pool: type) -> None:
    """Another connection to ``sqlite://`` is another, empty, database, and the app's own
    one cannot be shared: start() refuses, naming the rule and what to do instead; the app
    goes on sending."""
    engine = sqlite_memory(pool)
    migrate.upgrade(engine)
    ob = Outbox(engine, MemoryBroker())
    with pytest.raises(ConfigError, match=r"^db: the relay cannot .*in-memory SQLite") as refused:
        ob.start()
    assert "database file" in str(refused.value) and "ob.recording()" in str(refused.value)
    assert ob.relay is None
    with Session(engine) as session, session.begin():
        ob.send(session, "app.sent", {})
    assert ob.committed == 1
    ob.stop()
    engine.dispose()


def test_an_async_in_memory_sqlite_is_refused() -> None:
    """The relay's sync driver would open another, empty, database: refused when bound."""
    engine = create_async_engine("sqlite+aiosqlite://", poolclass=StaticPool)
    with pytest.raises(ConfigError, match="in-memory SQLite"):
        Outbox(engine, MemoryBroker()).start()


# --- The fixture that rolls back its outer transaction --------------------------------


def sqlite_begin_recipe(url: str) -> Engine:
    """SQLAlchemy's recipe for SAVEPOINTs on pysqlite: the driver's own transaction
    handling off (``isolation_level=None``), SQLAlchemy's BEGIN instead. Transactional,
    though the driver looks like autocommit: send() must accept it."""
    engine = create_engine(url, connect_args={"timeout": 1})

    @event.listens_for(engine, "connect")
    def no_driver_transactions(dbapi_connection: Any, record: object) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN")

    return engine


@pytest.mark.parametrize("relay_first", [True, False], ids=["relay-first", "tables-first"])
@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_a_test_whose_outer_transaction_rolls_back_publishes_nothing(
    db: str, relay_first: bool, request: pytest.FixtureRequest
) -> None:
    """The fixture pattern: a Session joined to a Connection's outer transaction
    (``join_transaction_mode="create_savepoint"``); the code under test commits (a
    savepoint), the test rolls the outer transaction back. The commit cannot be proven
    from the session, so the relay re-reads the row (verify_commit), does not find it, and
    publishes nothing."""
    url = str(request.getfixturevalue("sqlite_url" if db == "sqlite" else "pg_url"))
    engine = sqlite_begin_recipe(url) if db == "sqlite" else create_engine(url)
    try:
        with relay_on(engine, url, relay_first) as ob:
            with engine.connect() as conn:
                outer = conn.begin()
                with Session(bind=conn, join_transaction_mode="create_savepoint") as session:
                    ob.send(session, ROLLED_BACK, {"n": 1})
                    session.commit()  # releases the savepoint only
                stats = ob.stats
                assert stats is not None
                wait_until(lambda: stats.not_visible >= 1, what="the relay's look at the row")
                outer.rollback()
            assert ob.committed == 1  # handed over as committed, for the relay to check
            assert_only_the_witness_is_published(url, memory_broker(ob))
    finally:
        engine.dispose()


# --- AUTOCOMMIT: send() refuses before writing ---------------------------------------

SYNC_SETUPS = ["engine", "option-engine", "connection", "session", "driver"]
DRIVER_AUTOCOMMIT = {  # the driver's own autocommit, behind SQLAlchemy's back
    "postgresql": {"autocommit": True},  # psycopg
    "sqlite": {"isolation_level": None},  # pysqlite's legacy autocommit
    "mysql": {"autocommit": True},  # PyMySQL
}
DETECTS_DRIVER = hasattr(Dialect, "detect_autocommit_setting")  # SQLAlchemy 2.1


def autocommitting(conn: Connection) -> Connection:
    return conn.execution_options(isolation_level="AUTOCOMMIT")


@contextlib.contextmanager
def autocommit_session(setup: str, url: str) -> Iterator[Session]:
    """A Session whose connection autocommits, set up at one of the levels an app can."""
    if setup == "driver" and not DETECTS_DRIVER:
        pytest.skip("SQLAlchemy before 2.1 cannot tell a driver's own autocommit")
    backend = create_engine(url).dialect.name
    if setup == "engine":
        engine = create_engine(url, isolation_level="AUTOCOMMIT")
    elif setup == "driver":
        engine = create_engine(url, connect_args=DRIVER_AUTOCOMMIT[backend])
    else:
        engine = create_engine(url)
    try:
        if setup == "option-engine":
            with Session(engine.execution_options(isolation_level="AUTOCOMMIT")) as session:
                yield session
        elif setup == "connection":
            with engine.connect() as conn, Session(bind=autocommitting(conn)) as session:
                yield session
        else:
            with Session(engine) as session:
                if setup == "session":
                    session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
                yield session
    finally:
        engine.dispose()


@pytest.mark.parametrize("setup", SYNC_SETUPS)
def test_send_refuses_an_autocommitting_session_before_writing(any_db: str, setup: str) -> None:
    """Without the check, the INSERT committed at once: the row stayed after the rollback
    of the work around it."""
    migrate.upgrade(any_db)
    engine = create_engine(any_db)
    ob = Outbox(engine)
    try:
        with autocommit_session(setup, any_db) as session:
            with pytest.raises(NotTransactional, match=r"AUTOCOMMIT.*nothing was written"):
                ob.send(session, ROLLED_BACK, {"n": 1})
            with pytest.raises(NotTransactional):  # ordered: staged, and refused at send()
                ob.send(session, ROLLED_BACK, {"n": 2}, key="k", ordered=True)
            session.rollback()
        assert count_rows(any_db, outbox_message.c.topic == ROLLED_BACK) == 0
        assert ob.committed == 0
    finally:
        ob.stop()
        engine.dispose()


@pytest.mark.parametrize("setup", ["engine", "connection", "session"])
def test_cancel_refuses_an_autocommitting_session(any_db: str, setup: str) -> None:
    """Without the check, the cancel's UPDATE committed at once and stood after the
    rollback of the work around it: the scheduled message was never published."""
    migrate.upgrade(any_db)
    engine = create_engine(any_db)
    ob = Outbox(engine)
    try:
        with Session(engine) as session, session.begin():
            msg_id = ob.send(session, ROLLED_BACK, {"n": 1}, delay=3600)
        with autocommit_session(setup, any_db) as session:
            with pytest.raises(NotTransactional, match=r"AUTOCOMMIT.*nothing was canceled"):
                ob.cancel(session, msg_id)
            session.rollback()
        with engine.connect() as conn:
            status = conn.execute(
                select(outbox_message.c.status).where(outbox_message.c.msg_id == uuid.UUID(msg_id))
            ).scalar_one()
        assert status == PENDING
    finally:
        ob.stop()
        engine.dispose()


@pytest.mark.parametrize("relay_first", [True, False], ids=["relay-first", "tables-first"])
@pytest.mark.parametrize("setup", ["engine", "connection"])
def test_a_request_failing_after_send_on_autocommit_publishes_nothing(
    db_url: str, setup: str, relay_first: bool
) -> None:
    """The request's shape: send(), then an error, then the rollback; a relay running."""
    engine = create_engine(db_url)
    try:
        with relay_on(engine, db_url, relay_first) as ob:
            with autocommit_session(setup, db_url) as session:
                with pytest.raises(NotTransactional):
                    ob.send(session, ROLLED_BACK, {"n": 1})
                session.rollback()
            assert_only_the_witness_is_published(db_url, memory_broker(ob))
    finally:
        engine.dispose()


ASYNC_SETUPS = ["engine", "connection", "session", "driver"]
ASYNC_DRIVER_AUTOCOMMIT = {"postgresql": {"autocommit": True}, "sqlite": {"isolation_level": None}}


@pytest.mark.parametrize("relay_first", [True, False], ids=["relay-first", "tables-first"])
@pytest.mark.parametrize("setup", ASYNC_SETUPS)
def test_an_async_send_refuses_autocommit_before_the_row_is_written(
    db_url: str, setup: str, relay_first: bool
) -> None:
    """AsyncSession: refused at send() when the engine, the bound connection or the
    connection the transaction holds says AUTOCOMMIT; a driver's own autocommit is seen
    once connected, at COMMIT, before the staged row is written."""
    if setup == "driver" and not DETECTS_DRIVER:
        pytest.skip("SQLAlchemy before 2.1 cannot tell a driver's own autocommit")
    sync_engine = create_engine(db_url)
    backend = sync_engine.dialect.name
    url = async_url(sync_engine.url)
    kw: dict[str, Any] = {}
    if setup == "engine":
        kw["isolation_level"] = "AUTOCOMMIT"
    elif setup == "driver":
        kw["connect_args"] = ASYNC_DRIVER_AUTOCOMMIT[backend]
    engine = create_async_engine(url, **kw)  # psycopg's async side: the URL's search_path

    async def case(ob: Outbox) -> None:
        async with contextlib.AsyncExitStack() as stack:
            if setup == "connection":
                conn = await stack.enter_async_context(engine.connect())
                await conn.execution_options(isolation_level="AUTOCOMMIT")
                session = await stack.enter_async_context(AsyncSession(bind=conn))
            else:
                session = await stack.enter_async_context(AsyncSession(engine))
            if setup == "session":
                await session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
            if setup == "driver":
                ob.send(session, ROLLED_BACK, {"n": 1})  # not connected yet: staged
                with pytest.raises(NotTransactional):
                    await session.commit()
            else:
                with pytest.raises(NotTransactional, match="AUTOCOMMIT"):
                    ob.send(session, ROLLED_BACK, {"n": 1})
            await session.rollback()
        await engine.dispose()

    try:
        with relay_on(sync_engine, db_url, relay_first) as ob:
            asyncio.run(case(ob))
            assert ob.committed == 0
            assert_only_the_witness_is_published(db_url, memory_broker(ob))
    finally:
        sync_engine.dispose()


# --- The relay's engine ----------------------------------------------------------------


@pytest.mark.parametrize("pool", [None, NullPool])
def test_a_pool_of_distinct_connections_is_shared_with_the_relay(
    sqlite_url: str, pool: Any
) -> None:
    """One engine and one pool for the app and its relay, where the pool allows it."""
    engine = create_engine(sqlite_url, **({"poolclass": pool} if pool else {}))
    assert relay_engine(engine) is engine
    engine.dispose()


def test_the_relays_own_engine_connects_as_the_apps_does(pg_url: str) -> None:
    """Under StaticPool the relay's engine is its own, with the app's driver arguments,
    connect listeners and execution options: it reaches the same table (a listener's
    search_path, a schema_translate_map), through connections that are not the app's."""
    engine = create_engine(pg_url, poolclass=StaticPool,
                           execution_options={"schema_translate_map": {None: None}})  # fmt: skip
    heard: list[object] = []
    event.listen(engine, "connect", lambda dbapi, record: heard.append(dbapi))
    own = relay_engine(engine)
    try:
        assert own is not engine and own.pool is not engine.pool
        assert own.get_execution_options() == engine.get_execution_options()
        with engine.connect() as app, own.connect() as relay:
            path = text("SELECT current_setting('search_path')")
            assert relay.execute(path).scalar() == app.execute(path).scalar()
            pid = text("SELECT pg_backend_pid()")
            assert relay.execute(pid).scalar() != app.execute(pid).scalar()
        assert len(heard) == 2  # the app's listener ran for the relay's connection too
    finally:
        own.dispose()
        engine.dispose()
