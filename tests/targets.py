"""Broker namespaces of a test's own (NATS JetStream on a server of its own, RabbitMQ
and Redis with names and keys of its own) and how to read back what they hold.

NATS and Redis are read back with their adapter modules' readers (relay.brokers.nats,
relay.brokers.redis). RabbitMQ keeps no log but the audit stream; the tests bind a
queue of their own instead and drain it, which reads each message's body and headers."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import pytest
import redis

from outbox.message import DEDUP_HEADER
from relay.brokers.nats import read_stream
from relay.brokers.redis import xrange_pages
from relay.testing.embedded import NatsServer

RABBIT_URL = "amqp://guest:guest@127.0.0.1:5672/"
REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True)
class Carried:
    """One message as the broker holds it."""

    msg_id: str
    topic: str
    payload: bytes
    headers: dict[str, str]


@dataclass
class Target:
    """A broker namespace of the test's own: where to publish, how to read it back, and
    rows this broker cannot take (why -> plant columns, a piece of the expected error)."""

    url: str
    prefix: str  # every healthy topic starts with it
    read: Callable[[], list[Carried]]
    poisons: dict[str, tuple[dict[str, Any], str]] = field(default_factory=dict)


def nats_target(server: NatsServer, tag: str) -> Target:
    stream, prefix = f"P_{tag}", f"p{tag}"

    def read() -> list[Carried]:  # fails if the stream was deleted
        stored = asyncio.run(read_stream(server.url, stream))
        return [
            Carried(m.msg_id or "", m.subject, m.data, without(m.headers, DEDUP_HEADER))
            for m in stored
        ]

    return Target(
        f"{server.url}?stream={stream}&subjects={prefix}.>",
        prefix,
        read,
        {
            "oversize for the server's max_payload": (
                dict(topic=f"{prefix}.big", payload=b"x" * (1024 * 1024)),
                "MaxPayloadError",
            ),
            "a subject no stream captures": (
                dict(topic=f"elsewhere{tag}.x"),
                "no JetStream stream captures subject",
            ),
            "the server's API": (dict(topic=f"$JS.API.STREAM.DELETE.{stream}"), ""),
        },
    )


def rabbit_target(tag: str) -> Iterator[Target]:
    prefix, queue = f"p{tag}", f"poison-{tag}"

    async def declare() -> None:
        connection = await aio_pika.connect(RABBIT_URL)
        channel = await connection.channel()
        q = await channel.declare_queue(queue, arguments={"x-expires": 120_000})
        await q.bind("amq.topic", routing_key=f"{prefix}.#")
        await connection.close()

    async def drain() -> list[Carried]:
        connection = await aio_pika.connect(RABBIT_URL)
        channel = await connection.channel()
        q = await channel.get_queue(queue)
        found: list[Carried] = []
        while (m := await q.get(fail=False, no_ack=True)) is not None:
            headers = {k: str(v) for k, v in (m.headers or {}).items()}
            found.append(Carried(m.message_id or "", m.routing_key or "", m.body, headers))
        await connection.close()
        return found

    async def delete() -> None:
        connection = await aio_pika.connect(RABBIT_URL)
        channel = await connection.channel()
        await channel.queue_delete(queue)
        await connection.close()

    asyncio.run(declare())
    seen: list[Carried] = []

    def read() -> list[Carried]:  # a queue hands each message out once: keep what was read
        seen.extend(asyncio.run(drain()))
        return list(seen)

    yield Target(
        RABBIT_URL,
        prefix,
        read,
        {
            "a routing key over 255 bytes": (
                dict(topic=f"{prefix}.{'é' * 130}"),
                "272",  # the contract refuses the row; the fast path's adapter, the message
            ),
            "a topic no queue binds": (dict(topic=f"unbound{tag}.x"), "unroutable"),
        },
    )
    asyncio.run(delete())


def redis_target(tag: str) -> Iterator[Target]:
    key_prefix, prefix = f"t{tag}:", f"p{tag}"
    client = redis.Redis.from_url(REDIS_URL)
    client.set(f"{key_prefix}{prefix}.wrong", "not a stream")  # XADD to it: WRONGTYPE

    def read() -> list[Carried]:
        found: list[Carried] = []
        for key in client.scan_iter(match=f"{key_prefix}*"):
            if client.type(key) != b"stream":
                continue
            topic = key.decode().removeprefix(key_prefix)
            for page in xrange_pages(client, key.decode()):  # the adapter module's reader
                for _, f in page:
                    headers = json_object(f[b"headers"])
                    found.append(Carried(f[b"msg_id"].decode(), topic, f[b"payload"], headers))
        return found

    yield Target(
        f"{REDIS_URL}?prefix={key_prefix}",
        prefix,
        read,
        {"a key of the wrong type": (dict(topic=f"{prefix}.wrong"), "WRONGTYPE")},
    )
    keys = list(client.scan_iter(match=f"{key_prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def json_object(raw: bytes) -> dict[str, str]:
    value = json.loads(raw)
    assert isinstance(value, dict)
    return value


def without(headers: dict[str, str], name: str) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k != name}


@pytest.fixture(params=["nats", "rabbitmq", "redis"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    tag = uuid.uuid4().hex[:10]
    if request.param == "nats":
        with NatsServer() as server:
            yield nats_target(server, tag)
    elif request.param == "rabbitmq":
        yield from rabbit_target(tag)
    else:
        yield from redis_target(tag)
