"""send() and @transactional against real PostgreSQL and SQLite."""

from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, create_engine, func, select
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


def test_commit_writes_one_row_with_every_field(ob: Outbox, engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        db_before = session.execute(select(func.current_timestamp())).scalar_one()
        msg_id = ob.send(
            session,
            "warehouse.inbound",
            {"sku": "A-1", "qty": 3},
            key="A-1",
            tags=["inbound", "eu"],
            headers={"trace": "t-1"},
        )
    [row] = rows(engine)
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


def test_rollback_leaves_nothing(ob: Outbox, engine: Engine) -> None:
    with Session(engine) as session:
        ob.send(session, "warehouse.inbound", b"gone")
        session.rollback()
    assert rows(engine) == []
    assert ob.committed == 0


def test_closing_without_commit_hands_nothing_to_a_later_commit(ob: Outbox, engine: Engine) -> None:
    """A bug here would publish a rolled-back message when the same session commits later."""
    session = Session(engine)
    ob.send(session, "warehouse.inbound", b"abandoned")
    session.close()
    with session.begin():
        ob.send(session, "warehouse.inbound", b"kept")
    session.close()
    assert [r["payload"] for r in rows(engine)] == [b"kept"]
    assert ob.committed == 1


def test_savepoint_rollback_drops_only_its_messages(ob: Outbox, engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        ob.send(session, "warehouse.inbound", b"outer")
        with session.begin_nested():
            ob.send(session, "warehouse.inbound", b"released")
        savepoint = session.begin_nested()
        ob.send(session, "warehouse.inbound", b"rolled-back")
        savepoint.rollback()
    assert sorted(r["payload"] for r in rows(engine)) == [b"outer", b"released"]  # type: ignore[type-var]
    assert ob.committed == 2, "the rolled-back savepoint's message must not reach the relay"


def test_exception_in_decorated_handler_leaves_no_row(ob: Outbox, engine: Engine) -> None:
    @ob.transactional
    def receive(session: Session, sku: str) -> None:
        session.execute(inbound.insert().values(sku=sku))
        ob.send(session, "warehouse.inbound", {"sku": sku})
        raise RuntimeError("validation failed after send")

    with pytest.raises(RuntimeError, match="validation failed"):
        receive("A-1")
    assert count(engine, inbound) == 0
    assert rows(engine) == []
    assert ob.committed == 0


def test_decorated_handler_commits_on_return(ob: Outbox, engine: Engine) -> None:
    @ob.transactional
    def receive(session: Session, sku: str) -> str:
        session.execute(inbound.insert().values(sku=sku))
        return ob.send(session, "warehouse.inbound", {"sku": sku})

    msg_id = receive("A-1")
    assert count(engine, inbound) == 1
    assert [str(r["msg_id"]) for r in rows(engine)] == [msg_id]


def test_nested_decorated_calls_are_one_transaction(ob: Outbox, engine: Engine) -> None:
    sessions: list[Session] = []

    @ob.transactional
    def inner(session: Session, sku: str) -> None:
        sessions.append(session)
        session.execute(inbound.insert().values(sku=sku))
        ob.send(session, "warehouse.inbound", sku)

    @ob.transactional
    def outer(session: Session, fail: bool) -> None:
        sessions.append(session)
        inner("A-1")
        inner("A-2")
        if fail:
            raise LookupError("outer fails after both inner calls returned")

    with pytest.raises(LookupError):
        outer(fail=True)
    assert sessions[0] is sessions[1] is sessions[2]
    assert count(engine, inbound) == 0 and rows(engine) == []
    outer(fail=False)
    assert count(engine, inbound) == 2 and len(rows(engine)) == 2


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
    ob: Outbox, engine: Engine, override: dict[str, object], error: type[InvalidMessage], field: str
) -> None:
    args: dict[str, object] = {"topic": "warehouse.inbound", "payload": b"ok"}
    args.update(override)
    with Session(engine) as session, session.begin():
        session.execute(inbound.insert().values(sku="A-1"))
        with pytest.raises(error) as err:
            ob.send(session, args.pop("topic"), args.pop("payload"), **args)  # type: ignore[arg-type]
        assert err.value.field == field
        ob.send(session, "warehouse.inbound", b"after the error")
    assert count(engine, inbound) == 1
    assert [r["payload"] for r in rows(engine)] == [b"after the error"]


def test_session_of_another_database_is_refused(
    ob: Outbox, engine: Engine, tmp_path: object
) -> None:
    other = create_engine(f"sqlite:///{tmp_path}/other.sqlite")
    with (
        Session(other) as session,
        session.begin(),
        pytest.raises(WrongDatabase, match="session: bound to"),
    ):
        ob.send(session, "warehouse.inbound", b"x")
    assert rows(engine) == []


def test_session_bound_to_nothing_is_refused(ob: Outbox, engine: Engine) -> None:
    with Session() as session, pytest.raises(ConfigError, match="session: is bound to no"):
        ob.send(session, "warehouse.inbound", b"x")
    assert rows(engine) == []


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


def test_app_session_with_same_url_is_accepted(ob: Outbox, engine: Engine) -> None:
    """The app's own Engine for the same database is fine: only the URL must match."""
    app_engine = create_engine(engine.url)
    with Session(app_engine) as session, session.begin():
        ob.send(session, "warehouse.inbound", b"x")
    app_engine.dispose()
    assert len(rows(engine)) == 1
