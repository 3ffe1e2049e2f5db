"""examples/fastapi_sqlmodel's own tests, as a FastAPI + SQLModel app's suite has them.

FastAPI's TestClient without ``with`` (the lifespan and its relay do not run), the
``get_session`` dependency replaced by one on the test database (one PostgreSQL schema
for the module: an Outbox serves one database), ``ob`` bound to it and started on a
``MemoryBroker`` without the sweeper, ``ob.recording()`` for what a request sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, delete, func, select
from sqlmodel import Session, SQLModel, create_engine

import outbox.migrate
from examples.fastapi_sqlmodel.app import app, get_session, ob
from examples.fastapi_sqlmodel.models import Inbound
from examples.warehouse import TOPIC
from outbox.table import outbox_message
from relay.testing import MemoryBroker, scratch_schema
from tests.acceptance.hostile import HOSTILE, raw
from tests.conftest import PG_URL
from tests.helpers import wait_until


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    """The test database: the outbox's tables and the app's, ``ob`` bound to it."""
    with scratch_schema(PG_URL, "sqlmodel") as url:
        engine = create_engine(url)
        outbox.migrate.upgrade(engine)
        SQLModel.metadata.create_all(engine)
        ob.bind(engine)
        yield engine
        engine.dispose()


@pytest.fixture
def client(engine: Engine) -> Iterator[TestClient]:
    """The app with its requests' Sessions on the test database; rows gone after the test."""

    def session_on_the_test_database() -> Iterator[Session]:
        with Session(engine) as session:
            yield session

    app.dependency_overrides[get_session] = session_on_the_test_database
    yield TestClient(app)
    app.dependency_overrides.clear()
    ob.stop()
    with Session(engine) as session:
        session.execute(delete(Inbound))
        session.execute(delete(outbox_message))
        session.commit()


@pytest.fixture
def broker(client: TestClient) -> MemoryBroker:
    broker = MemoryBroker()
    ob.start(broker=broker, sweeper=False)
    return broker


def stored(engine: Engine) -> tuple[int, int]:
    with Session(engine) as session:
        rows = session.scalar(select(func.count()).select_from(Inbound))
        messages = session.scalar(select(func.count()).select_from(outbox_message))
    return int(rows or 0), int(messages or 0)


def test_a_delivery_is_stored_and_its_message_published(
    engine: Engine, client: TestClient, broker: MemoryBroker
) -> None:
    body = {"sku": "A-100", "quantity": 12, "dock": "D1", "tags": ["pallet"]}
    reply = client.post("/inbound", json=body)
    assert reply.status_code == 201, reply.json()
    wait_until(lambda: broker.published, timeout=30, what="the message published")
    [message] = broker.published
    assert (message.msg_id, message.topic, message.key) == (reply.json()["msg_id"], TOPIC, "A-100")
    assert json.loads(message.payload) == {"id": reply.json()["id"], "sku": "A-100", "quantity": 12}
    assert message.tags == "pallet"
    assert stored(engine) == (1, 1)


def test_a_closed_dock_rolls_back_the_row_and_the_message(
    engine: Engine, client: TestClient, broker: MemoryBroker
) -> None:
    """send() ran (the recording shows it), then the request failed: nothing is kept."""
    with ob.recording() as sent:
        reply = client.post("/inbound", json={"sku": "A-1", "quantity": 5, "dock": "D9"})
    assert reply.status_code == 409 and "closed" in reply.json()["error"]
    assert [m.key for m in sent] == ["A-1"]
    assert stored(engine) == (0, 0)
    assert client.post("/inbound", json={"sku": "OK", "quantity": 1}).status_code == 201
    wait_until(lambda: broker.published, timeout=30, what="the good message")
    assert [m.key for m in broker.published] == ["OK"]


def test_a_message_send_refuses_is_a_400_naming_the_field_and_keeps_nothing(
    engine: Engine, client: TestClient
) -> None:
    reply = client.post("/inbound", json={"sku": "A-1", "quantity": 1, "tags": ["two words"]})
    assert reply.status_code == 400 and reply.json()["error"].startswith("tags"), reply.json()
    assert stored(engine) == (0, 0)


def named_fields(reply: Any) -> set[str]:
    """The body fields FastAPI's 422 detail names (``loc`` is ["body", field, ...])."""
    return {str(error["loc"][1]) for error in reply.json()["detail"] if len(error["loc"]) > 1}


def test_hostile_bodies_get_422_naming_the_field_and_send_nothing(
    engine: Engine, client: TestClient
) -> None:
    with ob.recording() as sent:
        for body, field in HOSTILE:
            reply = client.post("/inbound", content=raw(body),
                                headers={"content-type": "application/json"})  # fmt: skip
            assert reply.status_code == 422, (repr(body)[:80], reply.text[:300])
            assert named_fields(reply) == {field}, (repr(body)[:80], reply.text[:300])
    assert sent == [] and stored(engine) == (0, 0)


def test_in_a_transaction_that_rolls_back_the_recording_shows_what_was_sent(
    engine: Engine, client: TestClient
) -> None:
    """A suite whose fixture rolls back: the route's commit releases a savepoint of the
    test's transaction, so nothing is ever committed, yet the recording has the message."""
    with engine.connect() as connection:
        outer = connection.begin()

        def session_in_the_tests_transaction() -> Iterator[Session]:
            with Session(connection, join_transaction_mode="create_savepoint") as session:
                yield session

        app.dependency_overrides[get_session] = session_in_the_tests_transaction
        with ob.recording() as sent:
            reply = client.post("/inbound", json={"sku": "R-1", "quantity": 2})
        assert reply.status_code == 201, reply.json()
        assert [(m.msg_id, m.key) for m in sent] == [(reply.json()["msg_id"], "R-1")]
        outer.rollback()
    assert stored(engine) == (0, 0)
