"""send() refuses a session whose engine reaches another outbox_message table: every driver.

The matrix: for each supported driver, sync and async, a session whose engine differs
from the outbox's in one thing that picks the table (host, port, database, user, schema)
is refused with WrongDatabase naming that thing, before anything is written; where the
other target is reachable the refused transaction goes on and commits. An engine of the
app's own that reaches the same table, its schema set the driver's own way (URL
``options``, psycopg's ``connect_args``, asyncpg's ``server_settings``), is accepted.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
from sqlalchemy import URL, Engine, create_engine, make_url, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Outbox, migrate
from outbox.errors import ConfigError, WrongDatabase
from outbox.table import outbox_message
from outbox.target import search_path_setting
from relay.testing import scratch_schema
from tests.conftest import PG_URL, scratch_mariadb
from tests.flavours import drive, enter, maybe

SECRET = "s3cret-pw"
# driver -> (backend fixture, drivername, async?)
DRIVERS = {
    "psycopg": ("pg_url", "postgresql+psycopg", False),
    "psycopg_async": ("pg_url", "postgresql+psycopg_async", True),
    "asyncpg": ("pg_url", "postgresql+asyncpg", True),
    "pysqlite": ("sqlite_url", "sqlite+pysqlite", False),
    "aiosqlite": ("sqlite_url", "sqlite+aiosqlite", True),
    "pymysql": ("mariadb_url", "mysql+pymysql", False),
    "asyncmy": ("mariadb_url", "mysql+asyncmy", True),
}
SERVER_COMPONENTS = ("host", "port", "database", "user")
COMPONENTS = {
    "pg_url": (*SERVER_COMPONENTS, "schema"),
    "sqlite_url": ("database",),
    "mariadb_url": SERVER_COMPONENTS,
}
MATRIX = [
    pytest.param(driver, component, id=f"{driver}-{component}")
    for driver, (backend, _, _) in DRIVERS.items()
    for component in COMPONENTS[backend]
]


@dataclass(frozen=True)
class Parts:
    """Where a table is: the URL's parts and the schema (PostgreSQL's search_path)."""

    url: URL
    schema: str | None = None
    password: str | None = None  # put in the URL: it must never show in an error

    def engine(self, drivername: str, is_async: bool) -> Engine | AsyncEngine:
        """An engine of the app's own, its schema set the way its driver takes it."""
        url = self.url.set(drivername=drivername, password=self.password)
        args: dict[str, Any] = {}
        if self.schema is not None and drivername == "postgresql+asyncpg":
            args["server_settings"] = {"search_path": self.schema}
        elif self.schema is not None and drivername == "postgresql+psycopg_async":
            args["options"] = f"-c search_path={self.schema}"
        elif self.schema is not None:
            url = url.update_query_dict({"options": f"-csearch_path={self.schema}"})
        if is_async:
            return create_async_engine(url, connect_args=args, poolclass=NullPool)
        return create_engine(url, connect_args=args, poolclass=NullPool)


@dataclass
class Home:
    """The outbox's table, and how to reach a table that differs in one component."""

    ob: Outbox
    parts: Parts
    request: pytest.FixtureRequest

    def other(self, component: str) -> tuple[Parts, bool]:
        """Parts differing in ``component``, and whether they reach a server (to go on)."""
        parts, url = self.parts, self.parts.url
        if component == "schema":
            other = self.request.getfixturevalue("other_pg_url")
            return replace(parts, schema=search_path_setting(make_url(other).query)), True
        if component == "database" and url.get_backend_name() == "sqlite":
            tmp = self.request.getfixturevalue("tmp_path")
            return replace(parts, url=url.set(database=f"{tmp}/other.sqlite")), True
        if component == "database" and url.get_backend_name() == "postgresql":
            return replace(parts, url=url.set(database="postgres"), password=SECRET), True
        if component == "database":  # MariaDB: a database of the test's own
            other = make_url(self.request.getfixturevalue("other_mariadb_url"))
            return replace(parts, url=url.set(database=other.database)), True
        if component == "user" and url.get_backend_name() == "postgresql":
            role = self.request.getfixturevalue("pg_role")
            return replace(parts, url=url.set(username=role), password=SECRET), True
        # Not connected to: the refusal comes before the session's first statement.
        changed = {"host": {"host": "db.invalid"}, "port": {"port": 1}, "user": {"username": "u"}}
        return replace(parts, url=url.set(**changed[component]), password=SECRET), False


@pytest.fixture
def other_mariadb_url() -> Iterator[str]:
    """A second MariaDB database of this test's own (mariadb_url gives the first)."""
    with scratch_mariadb() as url:
        yield url


@pytest.fixture
def other_pg_url() -> Iterator[str]:
    """A second PostgreSQL schema of this test's own (pg_url gives the first)."""
    with scratch_schema(PG_URL, "o") as url:
        yield url


@pytest.fixture
def pg_role() -> Iterator[str]:
    """A PostgreSQL login role of this test's own (the server trusts local connections)."""
    role = f"r_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN"))
    try:
        yield role
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP ROLE {role}"))
        admin.dispose()


def make_home(request: pytest.FixtureRequest, driver: str) -> Iterator[Home]:
    fixture = DRIVERS[driver][0]
    url = make_url(str(request.getfixturevalue(fixture)))
    migrate.upgrade(url.render_as_string(hide_password=False))
    schema = search_path_setting(url.query)
    ob = Outbox(url.render_as_string(hide_password=False), sweeper=False)
    try:
        yield Home(ob, Parts(url.difference_update_query(["options"]), schema), request)
    finally:
        ob.stop()


@pytest.fixture
def home(request: pytest.FixtureRequest, driver: str) -> Iterator[Home]:
    yield from make_home(request, driver)


def run(is_async: bool, case: Callable[[], Any]) -> Any:
    return asyncio.run(case()) if is_async else drive(case())


def written(ob: Outbox) -> int:
    with ob.engine.connect() as conn:
        return len(conn.execute(select(outbox_message.c.msg_id)).all())


@pytest.mark.parametrize(("driver", "component"), MATRIX)
def test_a_session_on_another_table_is_refused(home: Home, driver: str, component: str) -> None:
    _, drivername, is_async = DRIVERS[driver]
    parts, reachable = home.other(component)
    engine = parts.engine(drivername, is_async)

    async def refused() -> str:
        session = AsyncSession(engine) if is_async else Session(engine)  # type: ignore[arg-type]
        try:
            async with enter(session) as s, enter(s.begin()):
                if reachable:  # the transaction is under way on the server
                    assert (await maybe(s.execute(select(1)))).scalar() == 1
                with pytest.raises(WrongDatabase) as err:
                    home.ob.send(s, "warehouse.inbound", b"x")
                if reachable:  # and goes on after the refusal, then commits
                    assert (await maybe(s.execute(select(2)))).scalar() == 2
        finally:
            await maybe(engine.dispose())
        return str(err.value)

    message = run(is_async, refused)
    assert f"another table ({component} " in message, message
    assert SECRET not in message
    assert written(home.ob) == 0


@pytest.mark.parametrize("driver", list(DRIVERS))
def test_a_session_on_the_same_table_is_accepted(home: Home, driver: str) -> None:
    """The app's own engine, whatever its driver and however it sets the schema."""
    _, drivername, is_async = DRIVERS[driver]
    engine = home.parts.engine(drivername, is_async)

    async def accepted() -> None:
        session = AsyncSession(engine) if is_async else Session(engine)  # type: ignore[arg-type]
        try:
            async with enter(session) as s, enter(s.begin()):
                home.ob.send(s, "warehouse.inbound", b"x")
        finally:
            await maybe(engine.dispose())

    run(is_async, accepted)
    assert written(home.ob) == 1


def test_the_issue_asyncpg_on_schema_a_given_to_an_outbox_of_schema_b(pg_url: str) -> None:
    """The probe of issue 21: accepted, the row landed in a and was published twice."""
    with scratch_schema(PG_URL, "a") as url_a:
        migrate.upgrade(url_a)
        migrate.upgrade(pg_url)
        a = create_async_engine(
            make_url(url_a)
            .set(drivername="postgresql+asyncpg")
            .difference_update_query(["options"]),
            connect_args={
                "server_settings": {"search_path": search_path_setting(make_url(url_a).query)}
            },
        )
        ob = Outbox(
            make_url(pg_url)
            .set(drivername="postgresql+asyncpg")
            .render_as_string(hide_password=False),
            sweeper=False,
        )

        async def send_in_a() -> None:
            try:
                async with AsyncSession(a) as session, session.begin():
                    with pytest.raises(WrongDatabase, match=r"another table \(schema "):
                        ob.send(session, "warehouse.inbound", b"x")
            finally:
                await a.dispose()
                await ob.stop_async()

        asyncio.run(send_in_a())
        for url in (url_a, pg_url):
            with create_engine(url, poolclass=NullPool).connect() as conn:
                assert conn.execute(select(outbox_message.c.msg_id)).all() == []


def test_an_apps_asyncpg_engine_gives_its_search_path_to_the_relays_engine(pg_url: str) -> None:
    """server_settings are outside asyncpg's URL: the relay's psycopg engine gets them too."""
    migrate.upgrade(pg_url)
    url = make_url(pg_url)
    schema = search_path_setting(url.query)
    app = create_async_engine(
        url.set(drivername="postgresql+asyncpg").difference_update_query(["options"]),
        connect_args={"server_settings": {"search_path": schema}},
    )
    ob = Outbox(app, sweeper=False)

    async def send() -> None:
        try:
            async with AsyncSession(app) as session, session.begin():
                ob.send(session, "warehouse.inbound", b"x")
        finally:
            await app.dispose()

    asyncio.run(send())
    assert written(ob) == 1  # the relay's engine reads the app's table
    ob.stop()


def test_an_async_engine_the_relay_cannot_follow_is_refused_at_construction() -> None:
    """Its connect_args reach another host than its URL: the relay's engine would not."""
    app = create_async_engine(
        "postgresql+asyncpg://postgres@127.0.0.1/test", connect_args={"host": "db.invalid"}
    )
    with pytest.raises(ConfigError, match=r"db: .*another table \(host 'db.invalid'"):
        Outbox(app, sweeper=False)
