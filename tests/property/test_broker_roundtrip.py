"""What send() accepts reaches each real broker byte for byte: topic, payload, msg_id,
every app header name and value, key and tags. Rows planted straight in the table go
the same way once recheck() lets them through.

Each example sends a few generated messages in one PostgreSQL transaction (refused
ones must be OutboxErrors), plants a few rows by hand, reads them back as the sweeper
does (outbox.rows.message_of), publishes them with the real adapter and reads them
back from the broker through its LogReader (relay.testing.harness: one harness for every
broker).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from sqlalchemy import Engine, insert, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from outbox import Outbox, outbox_message
from outbox.broker import Broker
from outbox.errors import InvalidHeaders, InvalidMessage, PayloadTooLarge
from outbox.message import (
    MAX_HEADER_BYTES,
    Message,
    build_message,
    carried_headers,
    encoded_size,
    recheck,
    uuid7,
)
from outbox.rows import message_of
from outbox.settings import Settings
from relay.brokers.nats import header_size, sent_headers
from relay.testing.embedded import NatsServer
from relay.testing.harness import BrokerUnderTest, broker_under_test
from tests.property import strategies as s
from tests.property.test_send_input import assert_stored_as_given


@dataclass(frozen=True)
class Received:
    msg_id: str
    topic: str
    payload: bytes
    headers: dict[str, Any]


@dataclass
class Rig:
    """One broker for the whole module (relay.testing.harness), its adapter connected once."""

    name: str
    prefix: str
    runner: asyncio.Runner
    broker: Broker
    under_test: BrokerUnderTest

    async def read(self, messages: Sequence[Message]) -> list[Received]:
        """The broker's entries for ``messages``, read back through its LogReader."""
        wanted = {m.msg_id for m in messages}
        got: list[Received] = []
        for entry in await self.under_test.read_async():
            if entry.msg_id not in wanted:
                continue
            if self.name == "rabbitmq":
                # The adapter also sets AMQP's content_type property (aio-pika drops an empty one).
                content_type = entry.properties["content_type"]
                assert content_type == (entry.headers.get("content-type") or None)
            got.append(Received(entry.msg_id or "", entry.topic, entry.payload, entry.headers))
        return got

    def expected_headers(self, message: Message) -> dict[str, str]:
        return carried_headers(message)  # NATS's Nats-Msg-Id comes back as the msg_id


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="module", params=["nats", "rabbitmq", "redis"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    server = request.getfixturevalue("nats_server") if request.param == "nats" else None
    with (
        broker_under_test(request.param, nats_server=server) as under_test,
        asyncio.Runner() as runner,
    ):
        broker = under_test.make()
        runner.run(broker.connect())
        try:
            yield Rig(request.param, under_test.prefix, runner, broker, under_test)
        finally:
            runner.run(broker.close())


specs = st.tuples(s.topic_part, s.payloads, s.keys, s.tags, s.headers)
planted_rows = st.tuples(
    s.topic_part,
    s.mostly(st.binary(max_size=256), s.text),
    s.keys,
    s.mostly(st.none() | s.clean_text, s.text),
    st.one_of(st.none(), st.dictionaries(s.header_names, s.header_values, max_size=4)),
)


def send_all(ob: Outbox, engine: Engine, prefix: str, batch: list[tuple[Any, ...]]) -> list[str]:
    """msg_ids of the messages send() accepted, all committed in one transaction."""
    sent: list[tuple[str, tuple[Any, ...]]] = []
    with Session(engine) as session, session.begin():
        for part, payload, key, tags, headers in batch:
            topic = f"{prefix}.{part}"
            try:
                msg_id = ob.send(session, topic, payload, key=key, tags=tags, headers=headers)
            except InvalidMessage as exc:
                event(f"refused by send: {type(exc).__name__}")
                continue
            sent.append((msg_id, (topic, payload, key, tags, headers)))
    for msg_id, (topic, payload, key, tags, headers) in sent:
        kw = {"key": key, "tags": tags, "headers": headers}
        assert_stored_as_given(read_row(engine, msg_id), topic, payload, **kw)
    return [msg_id for msg_id, _ in sent]


def plant_all(engine: Engine, prefix: str, rows: list[tuple[Any, ...]]) -> list[str]:
    """msg_ids of the rows written straight into the table (those the columns took)."""
    planted = []
    for part, payload, key, tags, headers in rows:
        msg_id = str(uuid7())
        body = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else payload
        values = {"msg_id": uuid.UUID(msg_id), "topic": f"{prefix}.{part}", "payload": body,
                  "key": key, "tags": tags, "headers": headers}  # fmt: skip
        try:
            with engine.begin() as conn:
                conn.execute(insert(outbox_message).values(values))
        except (DBAPIError, UnicodeError):
            event("planted row refused by the database")
            continue
        planted.append(msg_id)
    return planted


def read_row(engine: Engine, msg_id: str) -> Message:
    query = select(outbox_message).where(outbox_message.c.msg_id == uuid.UUID(msg_id))
    with engine.connect() as conn:
        return message_of(conn.execute(query).one())


def relayable(engine: Engine, msg_ids: list[str]) -> list[Message]:
    """The rows as the sweeper reads them, less those recheck() refuses."""
    messages = []
    for msg_id in msg_ids:
        message = read_row(engine, msg_id)
        try:
            recheck(message, max_payload_bytes=Settings().max_payload_bytes)
        except InvalidMessage as exc:
            event(f"planted row refused by recheck: {type(exc).__name__}")
            continue
        messages.append(message)
    return messages


@s.PROPERTY
@given(batch=st.lists(specs, min_size=1, max_size=4), planted=st.lists(planted_rows, max_size=2))
def test_accepted_messages_reach_the_broker_byte_for_byte(
    rig: Rig, pg_engine: Engine, batch: list[tuple[Any, ...]], planted: list[tuple[Any, ...]]
) -> None:
    msg_ids = send_all(Outbox(pg_engine), pg_engine, rig.prefix, batch)
    msg_ids += plant_all(pg_engine, rig.prefix, planted)
    messages = relayable(pg_engine, msg_ids)
    event(f"{len(messages)} message(s) published")
    results = rig.runner.run(rig.broker.publish(messages))
    assert [r.error for r in results if not r.ok] == []
    received = {r.msg_id: r for r in rig.runner.run(rig.read(messages))}
    assert sorted(received) == sorted(m.msg_id for m in messages), "each exactly once"
    for message in messages:
        got = received[message.msg_id]
        assert got.topic == message.topic
        assert got.payload == message.payload
        assert got.headers == rig.expected_headers(message)


def test_the_largest_message_send_accepts_fits_each_broker(rig: Rig, pg_engine: Engine) -> None:
    """At the default limit (nats-server's default max_payload) with the headers at their
    cap (JetStream's 65,535 bytes): each broker takes it whole; one byte more is refused."""
    ob = Outbox(pg_engine)
    limit, topic, kw = ob.settings.max_payload_bytes, f"{rig.prefix}.big", {"key": "k", "tags": "t"}
    probe = build_message(topic, b"", headers={"h": ""}, max_payload_bytes=limit, **kw)
    headers = {"h": "v" * (MAX_HEADER_BYTES - header_size(sent_headers(probe)))}
    payload = b"x" * (limit - MAX_HEADER_BYTES)
    with Session(pg_engine) as session, session.begin():
        msg_id = ob.send(session, topic, payload, headers=headers, **kw)
        with pytest.raises(PayloadTooLarge):
            ob.send(session, topic, payload + b"x", headers=headers, **kw)
        with pytest.raises(InvalidHeaders):
            ob.send(session, topic, b"", headers={"h": headers["h"] + "v"}, **kw)
    message = read_row(pg_engine, msg_id)
    assert encoded_size(message) == limit
    [result] = rig.runner.run(rig.broker.publish([message]))
    assert result.ok, result.error
    [got] = rig.runner.run(rig.read([message]))
    assert (got.msg_id, got.topic, got.payload) == (msg_id, topic, payload)
    assert got.headers == rig.expected_headers(message)
