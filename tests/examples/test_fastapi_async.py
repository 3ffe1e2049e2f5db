"""examples/fastapi_async's own tests, as an async FastAPI app's suite has them.

httpx's AsyncClient on the app (ASGITransport: the lifespan and its relay do not run),
one test database for the module (a PostgreSQL schema, asyncpg), ``ob`` started on a
``MemoryBroker`` without the sweeper, ``ob.recording()`` for what a request sent, and
the ``get_session`` dependency replaced where a test wants its own transaction.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import delete, func, make_url, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from examples.fastapi_async.app import create_app, get_session, ob, prepare
from examples.fastapi_async.models import Inbound
from examples.warehouse import TOPIC
from outbox.table import outbox_message
from relay.testing import MemoryBroker, scratch_schema
from tests.conftest import PG_URL
from tests.helpers import came_within

Scenario = Callable[[FastAPI, httpx.AsyncClient], Awaitable[None]]


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """The test database (an asyncpg URL): the outbox's tables and the app's."""
    with scratch_schema(PG_URL, "fastapi_async") as url:
        db = make_url(url).set(drivername="postgresql+asyncpg").render_as_string(False)
        ob.bind(db)
        prepare()
        yield db


@pytest.fixture
def run(database: str) -> Iterator[Callable[[Scenario], None]]:
    """Runs a scenario on a new app (its own engine: each test has its own event loop)
    with an AsyncClient; the rows are gone and the relay stopped after it."""

    def running(scenario: Scenario) -> None:
        asyncio.run(on_a_new_app(database, scenario))

    yield running
    ob.stop()
    with ob.engine.begin() as conn:  # the sync engine the outbox keeps beside the app's
        conn.execute(delete(Inbound))
        conn.execute(delete(outbox_message))


async def on_a_new_app(database: str, scenario: Scenario) -> None:
    app = create_app(database)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await scenario(app, client)
    finally:
        await app.state.sessions.kw["bind"].dispose()


async def stored(app: FastAPI) -> tuple[int, int]:
    async with app.state.sessions() as session:
        rows = await session.scalar(select(func.count()).select_from(Inbound))
        messages = await session.scalar(select(func.count()).select_from(outbox_message))
    return int(rows or 0), int(messages or 0)


async def published(broker: MemoryBroker) -> bool:
    """Whether the broker has a message within 30 s (the relay runs on its own threads)."""
    return await asyncio.to_thread(came_within, lambda: broker.published, 30.0, 0.005)


def test_a_delivery_is_stored_and_its_message_published(
    run: Callable[[Scenario], None],
) -> None:
    broker = MemoryBroker()

    async def scenario(app: FastAPI, client: httpx.AsyncClient) -> None:
        ob.start(broker=broker, sweeper=False)
        reply = await client.post("/inbound", json={"sku": "A-100", "quantity": 12, "tags": ["a"]})
        assert reply.status_code == 201, reply.json()
        assert await published(broker), "the message published"
        [message] = broker.published
        assert (message.msg_id, message.topic, message.key) == (
            reply.json()["msg_id"], TOPIC, "A-100"
        )  # fmt: skip
        assert json.loads(message.payload) == {"id": reply.json()["id"], "sku": "A-100",
                                               "quantity": 12}  # fmt: skip
        assert message.tags == "a"
        assert await stored(app) == (1, 1)

    run(scenario)


def test_a_closed_dock_rolls_back_the_row_and_the_message(
    run: Callable[[Scenario], None],
) -> None:
    """send() ran (the recording shows it), then the request failed: nothing is kept."""
    broker = MemoryBroker()

    async def scenario(app: FastAPI, client: httpx.AsyncClient) -> None:
        ob.start(broker=broker, sweeper=False)
        with ob.recording() as sent:
            reply = await client.post("/inbound", json={"sku": "A-1", "quantity": 5, "dock": "D9"})
        assert reply.status_code == 409 and "closed" in reply.json()["error"]
        assert [m.key for m in sent] == ["A-1"]
        assert await stored(app) == (0, 0)
        assert (await client.post("/inbound", json={"sku": "OK", "quantity": 1})).status_code == 201
        assert await published(broker), "the good message"
        assert [m.key for m in broker.published] == ["OK"]

    run(scenario)


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        ({"sku": "", "quantity": 1}, 422, "sku"),
        ({"sku": "A-1", "quantity": True}, 422, "quantity"),
        ({"sku": "A-1\n", "quantity": 1}, 422, "sku"),
        ({"sku": "A-1", "quantity": 1, "tags": ["two words"]}, 400, "tags"),
    ],
)
def test_a_refused_request_keeps_nothing(
    run: Callable[[Scenario], None], body: dict[str, object], status: int, error: str
) -> None:
    async def scenario(app: FastAPI, client: httpx.AsyncClient) -> None:
        reply = await client.post("/inbound", json=body)
        assert reply.status_code == status and error in reply.text, reply.text
        assert await stored(app) == (0, 0)

    run(scenario)


def test_in_a_transaction_that_rolls_back_the_recording_shows_what_was_sent(
    run: Callable[[Scenario], None],
) -> None:
    """``get_session`` replaced by a session in the test's own transaction, rolled back at
    its end: the route's commit releases a savepoint; the recording has the message."""

    async def scenario(app: FastAPI, client: httpx.AsyncClient) -> None:
        engine: AsyncEngine = app.state.sessions.kw["bind"]
        async with engine.connect() as connection:
            outer = await connection.begin()

            async def in_the_tests_transaction() -> AsyncIterator[AsyncSession]:
                async with AsyncSession(
                    connection, join_transaction_mode="create_savepoint", expire_on_commit=False
                ) as session:
                    yield session

            app.dependency_overrides[get_session] = in_the_tests_transaction
            with ob.recording() as sent:
                reply = await client.post("/inbound", json={"sku": "R-1", "quantity": 2})
            assert reply.status_code == 201, reply.json()
            assert [(m.msg_id, m.key) for m in sent] == [(reply.json()["msg_id"], "R-1")]
            await outer.rollback()
        assert await stored(app) == (0, 0)

    run(scenario)
