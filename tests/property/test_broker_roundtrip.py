"""What send() accepts reaches each real broker byte for byte: topic, payload, msg_id,
every app header name and value, key and tags. Rows planted straight in the table go
the same way once recheck() lets them through.

Each example sends a few generated messages in one PostgreSQL transaction (refused
ones must be OutboxErrors), plants a few rows by hand, reads them back as the sweeper
does (outbox.rows.message_of), publishes them with the real adapter and reads them
back from the broker the way a consumer does.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aio_pika
import nats
import pytest
import redis.asyncio as aioredis
from hypothesis import event, given
from hypothesis import strategies as st
from sqlalchemy import Engine, insert, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from outbox import Outbox, outbox_message
from outbox.config import Settings
from outbox.errors import InvalidHeaders, InvalidMessage, PayloadTooLarge
from outbox.message import (
    DEDUP_HEADER,
    MAX_HEADER_BYTES,
    Message,
    build_message,
    encoded_size,
    header_size,
    recheck,
    sent_headers,
    uuid7,
)
from outbox.rows import message_of
from relay.brokers import Broker, broker_for
from relay.testing.embedded import NatsServer
from tests.property import strategies as s
from tests.property.test_send_input import assert_stored_as_given

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
REDIS_URL = "redis://127.0.0.1:6379/0"
READ_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Received:
    msg_id: str
    topic: str
    payload: bytes
    headers: dict[str, Any]


# Reads the messages just published back from the broker, as a consumer does.
Reader = Callable[[Sequence[Message]], Awaitable[list[Received]]]


@dataclass
class Rig:
    """One broker for the whole module: an adapter, a reader and a topic prefix of its own."""

    name: str
    prefix: str
    runner: asyncio.Runner
    broker: Broker
    read: Reader
    dedup_header: bool  # NATS carries msg_id as a header too

    def expected_headers(self, message: Message) -> dict[str, str]:
        headers = sent_headers(message)
        if not self.dedup_header:
            del headers[DEDUP_HEADER]
        return headers


@asynccontextmanager
async def nats_parts(url: str, prefix: str) -> AsyncIterator[tuple[Broker, Reader]]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    stream = f"P_{prefix}"
    await js.add_stream(name=stream, subjects=[f"{prefix}.>"])
    consumer = await js.pull_subscribe(f"{prefix}.>", stream=stream)  # as a consumer reads

    async def read(messages: Sequence[Message]) -> list[Received]:
        got: list[Received] = []
        deadline = time.monotonic() + READ_TIMEOUT_S
        while len(got) < len(messages) and time.monotonic() < deadline:
            for msg in await consumer.fetch(len(messages) - len(got), timeout=READ_TIMEOUT_S):
                await msg.ack()
                headers = dict(msg.headers or {})
                got.append(Received(headers.get(DEDUP_HEADER, ""), msg.subject, msg.data, headers))
        return got

    broker = broker_for(url)
    await broker.connect()
    try:
        yield broker, read
    finally:
        await broker.close()
        await js.delete_stream(stream)
        await nc.close()


@asynccontextmanager
async def rabbit_parts(prefix: str) -> AsyncIterator[tuple[Broker, Reader]]:
    broker = broker_for(f"{AMQP_URL}?exchange={prefix}")
    await broker.connect()  # declares the exchange
    connection = await aio_pika.connect(AMQP_URL)
    channel = await connection.channel()
    exchange = await channel.get_exchange(prefix)
    queue = await channel.declare_queue(exclusive=True)
    await queue.bind(exchange, "#")

    async def read(messages: Sequence[Message]) -> list[Received]:
        got: list[Received] = []
        deadline = time.monotonic() + READ_TIMEOUT_S
        while len(got) < len(messages) and time.monotonic() < deadline:
            msg = await queue.get(no_ack=True, fail=False)
            if msg is None:
                await asyncio.sleep(0.005)  # poll, bounded by the deadline
                continue
            headers = dict(msg.headers)
            # The adapter also sets AMQP's content_type property (aio-pika drops an empty one).
            assert msg.content_type == (headers.get("content-type") or None)
            got.append(Received(msg.message_id or "", msg.routing_key or "", msg.body, headers))
        return got

    try:
        yield broker, read
    finally:
        await broker.close()
        await exchange.delete()
        await connection.close()


@asynccontextmanager
async def redis_parts(prefix: str) -> AsyncIterator[tuple[Broker, Reader]]:
    key_prefix = f"{prefix}:"
    broker = broker_for(f"{REDIS_URL}?prefix={key_prefix}")
    await broker.connect()
    client = aioredis.from_url(REDIS_URL)

    async def read(messages: Sequence[Message]) -> list[Received]:
        got: list[Received] = []
        async for key in client.scan_iter(match=f"{key_prefix}*"):  # every stream it wrote
            topic = key.decode()[len(key_prefix) :]
            for _, fields in await client.xrange(key):
                headers = json.loads(fields[b"headers"])
                got.append(Received(fields[b"msg_id"].decode(), topic, fields[b"payload"], headers))
            await client.delete(key)
        return got

    try:
        yield broker, read
    finally:
        await broker.close()
        async for key in client.scan_iter(match=f"{key_prefix}*"):
            await client.delete(key)
        await client.aclose()


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with NatsServer() as server:
        yield server.url


@pytest.fixture(scope="module", params=["nats", "rabbitmq", "redis"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    prefix = f"p{uuid.uuid4().hex[:10]}"
    if request.param == "nats":
        parts = nats_parts(request.getfixturevalue("nats_url"), prefix)
    elif request.param == "rabbitmq":
        parts = rabbit_parts(prefix)
    else:
        parts = redis_parts(prefix)
    with asyncio.Runner() as runner:
        broker, read = runner.run(parts.__aenter__())
        try:
            yield Rig(request.param, prefix, runner, broker, read, request.param == "nats")
        finally:
            runner.run(parts.__aexit__(None, None, None))


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
