"""What only async apps do: many tasks at once, staged writes, the hand-off to a running relay.

The cases a sync app shares (commit, rollback, savepoints, nesting, bad input, wrong
database) are in test_send.py, run there for every async driver too.
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import Engine, create_engine, event, func, make_url, select
from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session, async_sessionmaker

from outbox import Outbox, migrate, outbox_message
from outbox.engines import async_engine_from, is_async_url, server_settings, timeouts
from outbox.errors import ConfigError
from relay.brokers.nats import read_stream
from relay.testing.embedded import NatsServer
from tests.flavours import Flavour
from tests.helpers import wait_until


def msg_ids(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return [str(m) for m in conn.execute(select(outbox_message.c.msg_id)).scalars()]


def test_1000_concurrent_tasks_each_commit_their_own_message(async_flavour: Flavour) -> None:
    ob = async_flavour.ob

    @ob.transactional
    async def one(session: AsyncSession, n: int) -> str:
        await asyncio.sleep(0)  # let the other tasks in while this transaction is open
        return ob.send(session, "warehouse.inbound", {"n": n})

    async def all_at_once() -> list[str]:
        return await asyncio.gather(*(one(n) for n in range(1000)))

    sent = async_flavour.run(all_at_once)
    assert sorted(msg_ids(async_flavour.engine)) == sorted(sent)
    assert len(set(sent)) == 1000
    assert ob.committed == 1000


def test_tasks_started_inside_a_handler_get_their_own_sessions(async_flavour: Flavour) -> None:
    """An AsyncSession must not be used by two tasks at once: a child task opens its own."""
    ob = async_flavour.ob
    seen: list[AsyncSession] = []

    @ob.transactional
    async def child(session: AsyncSession) -> None:
        seen.append(session)
        ob.send(session, "warehouse.inbound", b"child")

    @ob.transactional
    async def parent(session: AsyncSession) -> None:
        seen.append(session)
        await child()  # awaited in this task: joins
        await asyncio.gather(child(), child())  # new tasks: their own transactions
        raise LookupError("the parent rolls back; its children's own commits stand")

    with pytest.raises(LookupError):
        async_flavour.run(parent)
    assert seen[1] is seen[0]
    assert len({id(s) for s in seen[2:]} | {id(seen[0])}) == 3
    assert len(msg_ids(async_flavour.engine)) == 2
    assert ob.committed == 2


def test_messages_are_staged_and_written_by_one_insert_before_commit(
    async_flavour: Flavour,
) -> None:
    ob = async_flavour.ob
    inserts: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO OUTBOX_MESSAGE"):
            inserts.append(statement)

    sync_engine = ob.async_engine.sync_engine
    event.listen(sync_engine, "before_cursor_execute", count)

    async def send_five() -> list[str]:
        async with AsyncSession(ob.async_engine) as session, session.begin():
            sent = [ob.send(session, "warehouse.inbound", {"n": n}) for n in range(5)]
            assert all(isinstance(msg_id, str) for msg_id in sent), "returned at once"
            assert inserts == [], "nothing is written by send() itself"
            staged = await session.scalar(select(func.count()).select_from(outbox_message))
            assert staged == 0, "the rows wait for the commit"
        return sent

    try:
        sent = async_flavour.run(send_five)
    finally:
        event.remove(sync_engine, "before_cursor_execute", count)
    assert len(inserts) == 1, "k messages cost one statement"
    assert sorted(msg_ids(async_flavour.engine)) == sorted(sent)


def test_async_scoped_session_is_accepted(async_flavour: Flavour) -> None:
    ob = async_flavour.ob

    async def send_scoped() -> str:
        scoped = async_scoped_session(
            async_sessionmaker(ob.async_engine), scopefunc=asyncio.current_task
        )
        async with scoped() as session, session.begin():
            msg_id = ob.send(scoped, "warehouse.inbound", b"scoped")
        await scoped.remove()
        return msg_id

    msg_id = async_flavour.run(send_scoped)
    assert msg_ids(async_flavour.engine) == [msg_id]


def test_an_async_app_hands_off_to_a_running_relay(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    """asyncpg app, sync relay: committed messages reach NATS by the fast path, no others."""
    migrate.upgrade(pg_url)
    name, prefix = stream
    db = pg_url.replace("postgresql+psycopg://", "postgresql+asyncpg://")
    ob = Outbox(db, broker=f"{nats_server.url}?stream={name}&subjects={prefix}.>")
    ob.start()

    @ob.transactional
    async def order(session: AsyncSession, n: int) -> str:
        msg_id = ob.send(session, f"{prefix}.orders", {"n": n})
        if n % 10 == 0:
            raise ValueError("out of stock")
        return msg_id

    async def orders() -> list[str | BaseException]:
        try:
            return await asyncio.gather(*(order(n) for n in range(200)), return_exceptions=True)
        finally:
            await ob.async_engine.dispose()

    try:
        results = asyncio.run(orders())
        committed = sorted(r for r in results if isinstance(r, str))
        assert len(committed) == 180
        wait_until(lambda: ob.stats is not None and ob.stats.published == 180, what="published")
        at_broker = asyncio.run(read_stream(nats_server.url, name))
        assert sorted(m.msg_id for m in at_broker if m.msg_id) == committed
        assert ob.handed_off == 180, "by the fast path, not the sweeper"
    finally:
        ob.stop()


@pytest.mark.parametrize(
    ("db", "relay_driver"),
    [
        ("postgresql+asyncpg://u@h/d?options=-csearch_path%3Ds", "postgresql+psycopg"),
        ("postgresql+psycopg_async://u@h/d", "postgresql+psycopg"),
        ("sqlite+aiosqlite:///x.sqlite", "sqlite+pysqlite"),
        ("mysql+asyncmy://u@h/d", "mysql+pymysql"),
    ],
)
def test_an_async_url_gets_a_sync_engine_of_the_same_database_for_the_relay(
    db: str, relay_driver: str
) -> None:
    """The relay's threads cannot use an async engine (its sync_engine needs the app's loop)."""
    ob = Outbox(db)
    assert is_async_url(db) and ob.async_engine.url.drivername == db.split(":")[0]
    assert ob.engine.url.drivername == relay_driver
    assert ob.engine.url.set(drivername="x") == ob.engine.url.set(drivername="x")
    assert ob.engine.url.database == ob.async_engine.url.database
    assert dict(ob.engine.url.query) == dict(make_url(db).query), "libpq options kept for psycopg"
    ob.stop()


def test_an_async_engine_given_keeps_its_libpq_options_for_the_relay() -> None:
    """asyncpg's engine URL lost ``options`` (now server_settings): the relay must not."""
    db = "postgresql+asyncpg://u@h/d?options=-csearch_path%3Ds"
    ob = Outbox(async_engine_from(db))
    assert dict(ob.engine.url.query) == {"options": "-csearch_path=s"}
    assert ob.engine.url.drivername == "postgresql+psycopg"
    ob.stop()


def test_asyncpg_takes_libpq_options_as_server_settings() -> None:
    assert server_settings("-csearch_path=a -c statement_timeout=5") == {
        "search_path": "a",
        "statement_timeout": "5",
    }
    with pytest.raises(ValueError, match="options"):
        server_settings("--verbose")
    url = make_url("postgresql+asyncpg://u@h/d")
    assert timeouts(url, 1.5, None) == {"timeout": 1.5}
    asyncmy = timeouts(url.set(drivername="mysql+asyncmy"), 1.5, None)
    assert asyncmy == {"connect_timeout": 1.5, "read_timeout": 1.5}, "its handshake reads too"
    pymysql = timeouts(url.set(drivername="mysql+pymysql"), 1.5, 30)
    assert pymysql == {"connect_timeout": 1.5, "read_timeout": 1.5, "write_timeout": 30}


@pytest.mark.parametrize("given", ["url", "engine"])
def test_a_sync_outbox_gets_its_async_engine_on_first_async_use(any_db: str, given: str) -> None:
    """Outbox(sync URL or Engine): async handlers work, and stop_async() closes what they opened."""
    app_engine = create_engine(any_db)
    migrate.upgrade(app_engine)
    ob = Outbox(app_engine if given == "engine" else any_db)
    assert ob._async_engine is None, "made on first async use, not before"
    opened: list[object] = []
    closed: list[object] = []

    @ob.transactional
    async def order(session: AsyncSession, n: int) -> str:
        return ob.send(session, "warehouse.inbound", {"n": n})

    async def app() -> list[str]:
        engine = ob.async_engine.sync_engine
        event.listen(engine, "connect", lambda conn, _: opened.append(conn))
        event.listen(engine.pool, "close", lambda conn, _: closed.append(conn))
        sent = list(await asyncio.gather(*(order(n) for n in range(3))))
        async with AsyncSession(ob.async_engine) as session, session.begin():
            sent.append(ob.send(session, "warehouse.inbound", b"own session"))
        assert opened and not closed, "pooled while the app runs"
        await ob.stop_async()
        return sent

    try:
        sent = asyncio.run(app())
        assert make_url(any_db).get_backend_name() in ob.async_engine.url.drivername
        assert ob.async_engine.dialect.is_async
        assert sorted(msg_ids(app_engine)) == sorted(sent)
        assert sorted(map(id, closed)) == sorted(map(id, opened)), "every connection closed"
    finally:
        app_engine.dispose()


@pytest.mark.parametrize("db", ["sqlite://", "sqlite+aiosqlite://", "sqlite:///:memory:"])
def test_an_in_memory_sqlite_database_is_not_split_between_drivers(db: str) -> None:
    """Each driver's connections would open an empty database of their own."""
    with pytest.raises(ConfigError, match="db: an in-memory SQLite database"):
        Outbox(db).async_engine  # noqa: B018
