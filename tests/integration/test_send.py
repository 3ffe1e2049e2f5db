"""send() and @transactional against real databases, from sync and from async apps.

Each shared case runs once per flavour (tests/flavours.py): a sync Session on
PostgreSQL and SQLite, and an AsyncSession on psycopg async, asyncpg, aiosqlite and
asyncmy (MariaDB).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from outbox import Outbox, outbox_message
from outbox.errors import (
    ConfigError,
    InvalidHeaders,
    InvalidKey,
    InvalidMessage,
    InvalidPayload,
    InvalidTopic,
    PayloadTooLarge,
    WrongDatabase,
)
from tests.flavours import Flavour, enter, maybe

business = MetaData()
inbound = Table(
    "inbound", business, Column("id", Integer, primary_key=True), Column("sku", String(40))
)


@pytest.fixture
def ob(engine: Engine) -> Iterator[Outbox]:
    business.create_all(engine)
    yield Outbox(engine, max_payload_bytes=1000)


def rows(engine: Engine) -> list[dict[str, object]]:
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(select(outbox_message))]


def count(engine: Engine, table: Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)  # SQLite keeps UTC, naive


@pytest.fixture
def case(flavour: Flavour) -> Flavour:
    business.create_all(flavour.engine)
    return flavour


def test_commit_writes_one_row_with_every_field(case: Flavour) -> None:
    ob = case.ob

    async def commit() -> tuple[str, datetime]:
        async with enter(case.session()) as session, enter(session.begin()):
            now = await maybe(session.execute(select(func.current_timestamp())))
            msg_id = ob.send(
                session,
                "warehouse.inbound",
                {"sku": "A-1", "qty": 3},
                key="A-1",
                tags=["inbound", "eu"],
                headers={"trace": "t-1"},
            )
            return msg_id, now.scalar_one()

    msg_id, db_before = case.run(commit)
    [row] = rows(case.engine)
    assert row["msg_id"] == uuid.UUID(msg_id) and uuid.UUID(msg_id).version == 7
    assert row["topic"] == "warehouse.inbound"
    assert row["key"] == "A-1"
    assert row["tags"] == "inbound,eu"
    assert row["headers"] == {"trace": "t-1", "content-type": "application/json"}
    assert row["payload"] == b'{"sku":"A-1","qty":3}'
    assert (row["status"], row["attempts"]) == ("pending", 0)
    assert row["next_attempt_at"] is row["last_error"] is row["sent_at"] is row["receipt"] is None
    created = aware(row["created_at"])  # type: ignore[arg-type]
    # created_at is stamped by the database clock, not the app's.
    assert (
        aware(db_before) - timedelta(seconds=1)
        <= created
        <= datetime.now(UTC) + timedelta(seconds=5)
    )
    assert ob.committed == 1


def test_rollback_leaves_nothing(case: Flavour) -> None:
    async def roll_back() -> None:
        async with enter(case.session()) as session:
            case.ob.send(session, "warehouse.inbound", b"gone")
            await maybe(session.rollback())

    case.run(roll_back)
    assert rows(case.engine) == []
    assert case.ob.committed == 0


def test_closing_without_commit_hands_nothing_to_a_later_commit(case: Flavour) -> None:
    """A bug here would publish a rolled-back message when the same session commits later."""

    async def abandon_then_commit() -> None:
        session = case.session()
        case.ob.send(session, "warehouse.inbound", b"abandoned")
        await maybe(session.close())
        async with enter(session.begin()):
            case.ob.send(session, "warehouse.inbound", b"kept")
        await maybe(session.close())

    case.run(abandon_then_commit)
    assert [r["payload"] for r in rows(case.engine)] == [b"kept"]
    assert case.ob.committed == 1


def test_savepoint_rollback_drops_only_its_messages(case: Flavour) -> None:
    async def savepoints() -> None:
        async with enter(case.session()) as session, enter(session.begin()):
            case.ob.send(session, "warehouse.inbound", b"outer")
            async with enter(session.begin_nested()):
                case.ob.send(session, "warehouse.inbound", b"released")
            savepoint = await maybe(session.begin_nested())
            case.ob.send(session, "warehouse.inbound", b"rolled-back")
            async with enter(session.begin_nested()):
                case.ob.send(session, "warehouse.inbound", b"inside the rolled-back one")
            await maybe(savepoint.rollback())

    case.run(savepoints)
    assert sorted(r["payload"] for r in rows(case.engine)) == [b"outer", b"released"]  # type: ignore[type-var]
    assert case.ob.committed == 2, "the rolled-back savepoint's message must not reach the relay"


def test_exception_in_decorated_handler_leaves_no_row(case: Flavour) -> None:
    async def body(session: Any, sku: str) -> None:
        await maybe(session.execute(inbound.insert().values(sku=sku)))
        case.ob.send(session, "warehouse.inbound", {"sku": sku})
        raise RuntimeError("validation failed after send")

    receive = case.transactional(body)
    with pytest.raises(RuntimeError, match="validation failed"):
        case.run(lambda: receive("A-1"))
    assert count(case.engine, inbound) == 0
    assert rows(case.engine) == []
    assert case.ob.committed == 0


def test_decorated_handler_commits_on_return(case: Flavour) -> None:
    async def body(session: Any, sku: str) -> str:
        await maybe(session.execute(inbound.insert().values(sku=sku)))
        return case.ob.send(session, "warehouse.inbound", {"sku": sku})

    receive = case.transactional(body)
    msg_id = case.run(lambda: receive("A-1"))
    assert count(case.engine, inbound) == 1
    assert [str(r["msg_id"]) for r in rows(case.engine)] == [msg_id]


def test_nested_decorated_calls_are_one_transaction(case: Flavour) -> None:
    sessions: list[object] = []

    async def inner_body(session: Any, sku: str) -> None:
        sessions.append(session)
        await maybe(session.execute(inbound.insert().values(sku=sku)))
        case.ob.send(session, "warehouse.inbound", sku)

    inner = case.transactional(inner_body)

    async def outer_body(session: Any, fail: bool) -> None:
        sessions.append(session)
        await inner("A-1")
        await inner("A-2")
        if fail:
            raise LookupError("outer fails after both inner calls returned")

    outer = case.transactional(outer_body)

    async def fail_then_succeed() -> None:
        with pytest.raises(LookupError):
            await outer(True)
        assert count(case.engine, inbound) == 0 and rows(case.engine) == []
        await outer(False)

    case.run(fail_then_succeed)
    assert sessions[0] is sessions[1] is sessions[2]
    assert sessions[3] is not sessions[0], "a new call after the first ended opens its own"
    assert count(case.engine, inbound) == 2 and len(rows(case.engine)) == 2
    assert case.ob.committed == 2


def test_threads_send_unique_messages(ob: Outbox, engine: Engine) -> None:
    errors: list[BaseException] = []

    @ob.transactional
    def one(session: Session, n: int) -> None:
        ob.send(session, "warehouse.inbound", {"n": n})

    def worker(base: int) -> None:
        try:
            for i in range(100):
                one(base + i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t * 100,)) for t in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    found = rows(engine)
    assert len(found) == 1000
    assert len({r["msg_id"] for r in found}) == 1000
    assert ob.committed == 1000


BAD_INPUTS = [
    pytest.param({"topic": ""}, InvalidTopic, "topic", id="empty-topic"),
    pytest.param({"topic": "a b"}, InvalidTopic, "topic", id="space-topic"),
    pytest.param({"topic": "a.*"}, InvalidTopic, "topic", id="wildcard-topic"),
    pytest.param({"topic": "a..b"}, InvalidTopic, "topic", id="empty-token"),
    pytest.param({"payload": object()}, InvalidPayload, "payload", id="unserialisable"),
    pytest.param({"payload": b"x" * 1001}, PayloadTooLarge, "payload", id="too-large"),
    pytest.param({"headers": {"n": 1}}, InvalidHeaders, "headers", id="header-value"),
    pytest.param({"headers": {2: "v"}}, InvalidHeaders, "headers", id="header-name"),
    pytest.param({"topic": "$JS.API.STREAM.DELETE.ORDERS"}, InvalidTopic, "topic", id="nats-api"),
    pytest.param({"topic": "é" * 200}, InvalidTopic, "topic", id="topic-over-255-bytes"),
    pytest.param({"headers": {"a/b": "v"}}, InvalidHeaders, "headers", id="header-not-token"),
    pytest.param({"headers": {"h": "  v  "}}, InvalidHeaders, "headers", id="header-edge-space"),
    pytest.param({"headers": {"h": "\udc00"}}, InvalidHeaders, "headers", id="header-surrogate"),
    pytest.param({"headers": {"h": "v" * 999}}, PayloadTooLarge, "payload", id="headers-count"),
    pytest.param({"key": "\udc00"}, InvalidKey, "key", id="key-surrogate"),
    pytest.param({"payload": ["\udc00"]}, InvalidPayload, "payload", id="json-surrogate"),
    pytest.param({"payload": "\udc00"}, InvalidPayload, "payload", id="str-surrogate"),
]


@pytest.mark.parametrize(("override", "error", "field"), BAD_INPUTS)
def test_bad_input_keeps_transaction_usable(
    case: Flavour, override: dict[str, object], error: type[InvalidMessage], field: str
) -> None:
    args: dict[str, object] = {"topic": "warehouse.inbound", "payload": b"ok"}
    args.update(override)

    async def bad_then_good() -> None:
        async with enter(case.session()) as session, enter(session.begin()):
            await maybe(session.execute(inbound.insert().values(sku="A-1")))
            with pytest.raises(error) as err:
                case.ob.send(session, args.pop("topic"), args.pop("payload"), **args)  # type: ignore[arg-type]
            assert err.value.field == field
            case.ob.send(session, "warehouse.inbound", b"after the error")

    case.run(bad_then_good)
    assert count(case.engine, inbound) == 1
    assert [r["payload"] for r in rows(case.engine)] == [b"after the error"]


def test_session_of_another_database_is_refused(case: Flavour, tmp_path: object) -> None:
    other = case.engine_for(f"sqlite:///{tmp_path}/other.sqlite")

    async def send_elsewhere() -> None:
        try:
            async with enter(case.session(other)) as session, enter(session.begin()):
                with pytest.raises(WrongDatabase, match="session: bound to"):
                    case.ob.send(session, "warehouse.inbound", b"x")
        finally:
            await maybe(other.dispose())

    case.run(send_elsewhere)
    assert rows(case.engine) == []


def test_session_bound_to_nothing_is_refused(case: Flavour) -> None:
    async def send_unbound() -> None:
        unbound = AsyncSession() if case.is_async else Session()
        async with enter(unbound) as session:
            with pytest.raises(ConfigError, match="session: is bound to no"):
                case.ob.send(session, "warehouse.inbound", b"x")

    case.run(send_unbound)
    assert rows(case.engine) == []


def test_app_session_with_same_url_is_accepted(case: Flavour) -> None:
    """The app's own Engine for the same database is fine: only the URL must match."""
    app_engine = case.same_engine()

    async def send_through_it() -> None:
        async with enter(case.session(app_engine)) as session, enter(session.begin()):
            case.ob.send(session, "warehouse.inbound", b"x")
        await maybe(app_engine.dispose())

    case.run(send_through_it)
    assert len(rows(case.engine)) == 1


def test_generator_functions_are_refused_at_decoration(ob: Outbox, engine: Engine) -> None:
    """Their body would run after the transaction closed: the msg_ids of nothing committed."""

    def handler(session: Session) -> Iterator[str]:
        yield ob.send(session, "warehouse.inbound", b"x")

    async def async_handler(session: Session) -> AsyncIterator[str]:
        yield ob.send(session, "warehouse.inbound", b"x")

    for fn in (handler, async_handler):
        with pytest.raises(ConfigError, match="generator functions are not supported"):
            ob.transactional(fn)  # type: ignore[arg-type]
    assert rows(engine) == []
