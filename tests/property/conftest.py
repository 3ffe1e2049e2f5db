"""Module-scoped databases: hypothesis runs many examples in one test function, so the
function-scoped fixtures of tests/conftest.py would be shared across them anyway."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine

from outbox import migrate
from relay.testing import scratch_schema
from tests.conftest import PG_URL, scratch_mariadb


@pytest.fixture(scope="module")
def pg_engine() -> Iterator[Engine]:
    """A migrated PostgreSQL schema of this module's own."""
    with scratch_schema(PG_URL, "prop") as url:
        engine = create_engine(url)
        migrate.upgrade(engine)
        yield engine
        engine.dispose()


@pytest.fixture(scope="module")
def mariadb_engine() -> Iterator[Engine]:
    """A migrated MariaDB database of this module's own."""
    with scratch_mariadb("prop") as url:
        engine = create_engine(url)
        migrate.upgrade(engine)
        yield engine
        engine.dispose()


@pytest.fixture(scope="module")
def sqlite_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path: Path = tmp_path_factory.mktemp("property") / "outbox.sqlite"
    engine = create_engine(f"sqlite:///{path}")
    migrate.upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module", params=["pg", "mariadb", "sqlite"])
def any_engine(request: pytest.FixtureRequest) -> Engine:
    engine: Engine = request.getfixturevalue(f"{request.param}_engine")
    return engine
