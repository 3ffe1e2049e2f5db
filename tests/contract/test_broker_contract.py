"""One contract for every broker adapter: NATS JetStream, Redis Streams, in-memory.

Each adapter must answer one result per message, in order, with a receipt; keep a
permanent failure to its own message; answer "retry" while the broker is down; and
publish again once it is back, without a new adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import pytest
import redis

from outbox.broker import Broker, Outcome, permanent
from outbox.message import Message, build_message, carried_headers
from relay.brokers import broker_for
from relay.brokers.nats import read_stream
from relay.brokers.redis import xrange_pages
from relay.testing.embedded import NatsServer
from relay.testing.faults import TcpProxy
from relay.testing.memory import MemoryBroker
from tests.servers import RedisServer


@dataclass
class Harness:
    name: str
    prefix: str
    make: Callable[[], Broker]
    read: Callable[[Broker, str], list[dict[str, Any]]]  # what the broker holds for a topic
    poison: Callable[[str], Message]  # a message this broker refuses for good
    dedup: bool  # the broker drops a second copy of a msg_id
    server: Any = None  # has stop() and start() when the broker can be restarted
    ordered_receipts: bool = True  # the reader sees the receipts the publisher got
    unique_receipts: bool = True  # one broker id per message (RabbitMQ acks cover several)


def nats_harness(server: NatsServer, prefix: str) -> Harness:
    stream = f"C_{prefix}"

    def read(broker: Broker, topic: str) -> list[dict[str, Any]]:
        stored = asyncio.run(read_stream(server.url, stream))
        return [
            {
                "msg_id": m.msg_id,
                "receipt": f"{stream}:{m.seq}",
                "headers": m.headers,
                "payload": m.data,
            }
            for m in stored
            if m.subject == topic
        ]

    return Harness(
        "nats",
        prefix,
        lambda: broker_for(f"{server.url}?stream={stream}&subjects={prefix}.>"),
        read,
        lambda topic: build_message(topic, b"x" * (1024 * 1024), max_payload_bytes=2**21),
        dedup=True,
        server=server,
    )


def redis_harness(server: RedisServer, prefix: str) -> Harness:
    def read(broker: Broker, topic: str) -> list[dict[str, Any]]:
        client = redis.Redis.from_url(server.url)
        entries = [entry for page in xrange_pages(client, topic) for entry in page]
        client.close()
        return [
            {
                "msg_id": f[b"msg_id"].decode(),
                "receipt": entry_id.decode(),
                "headers": json.loads(f[b"headers"]),
                "payload": f[b"payload"],
            }
            for entry_id, f in entries
        ]

    def poison(topic: str) -> Message:
        client = redis.Redis.from_url(server.url)
        client.set(topic, "not a stream")  # XADD to it fails with WRONGTYPE
        client.close()
        return build_message(topic, b"x", max_payload_bytes=1000)

    return Harness(
        "redis", prefix, lambda: broker_for(server.url), read, poison, dedup=False, server=server
    )


RABBIT_PORT = int(os.environ.get("OUTBOX_TEST_RABBIT_PORT", "5672"))


def rabbit_harness(proxy: TcpProxy, prefix: str) -> Harness:
    """RabbitMQ behind a TCP proxy (so a restart can be made without restarting the node).

    A queue of the test's own binds ``<prefix>.orders``; ``<prefix>.poison`` has no
    binding, so the broker returns it as unroutable.
    """
    url = f"amqp://guest:guest@127.0.0.1:{proxy.port}/"
    queue = f"contract-{prefix}"

    async def declare() -> None:
        connection = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{RABBIT_PORT}/")
        channel = await connection.channel()
        q = await channel.declare_queue(queue, auto_delete=False, arguments={"x-expires": 60_000})
        await q.bind("amq.topic", routing_key=f"{prefix}.orders")
        await connection.close()

    asyncio.run(declare())

    def read(broker: Broker, topic: str) -> list[dict[str, Any]]:
        async def drain() -> list[dict[str, Any]]:
            connection = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{RABBIT_PORT}/")
            channel = await connection.channel()
            q = await channel.get_queue(queue)
            found: list[dict[str, Any]] = []
            while (m := await q.get(fail=False, no_ack=True)) is not None:
                headers = {k: str(v) for k, v in (m.headers or {}).items()}
                found.append(
                    {"msg_id": m.message_id, "receipt": None, "headers": headers, "payload": m.body}
                )
            await connection.close()
            return found

        return asyncio.run(drain())

    return Harness(
        "rabbitmq",
        prefix,
        lambda: broker_for(url),
        read,
        lambda topic: build_message(topic, b"x", max_payload_bytes=1000),
        dedup=False,
        server=proxy,
        ordered_receipts=False,
        unique_receipts=False,
    )


def memory_harness(prefix: str) -> Harness:
    def make() -> Broker:
        return MemoryBroker(
            policy=lambda m: permanent("refused") if m.topic.endswith(".poison") else None
        )

    def read(broker: Broker, topic: str) -> list[dict[str, Any]]:
        assert isinstance(broker, MemoryBroker)
        return [
            {
                "msg_id": m.msg_id,
                "receipt": str(i + 1),
                "headers": carried_headers(m),
                "payload": m.payload,
            }
            for i, m in enumerate(broker.published)
            if m.topic == topic
        ]

    return Harness(
        "memory",
        prefix,
        make,
        read,
        lambda topic: build_message(topic, b"x", max_payload_bytes=1000),
        True,
    )


@contextlib.contextmanager
def harness_for(kind: str) -> Iterator[Harness]:
    prefix = f"c{uuid.uuid4().hex[:10]}"
    if kind == "nats":
        with NatsServer() as server:
            yield nats_harness(server, prefix)
    elif kind == "redis":
        server = RedisServer().start()
        try:
            yield redis_harness(server, prefix)
        finally:
            server.close()
    elif kind == "rabbitmq":
        proxy = TcpProxy(RABBIT_PORT).start()
        try:
            yield rabbit_harness(proxy, prefix)
        finally:
            proxy.stop()
    else:
        yield memory_harness(prefix)


@pytest.fixture(params=["nats", "redis", "rabbitmq", "memory"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    with harness_for(request.param) as h:
        yield h


@pytest.fixture(params=["nats", "redis", "rabbitmq"])
def restartable(request: pytest.FixtureRequest) -> Iterator[Harness]:
    with harness_for(request.param) as h:
        yield h


def run(broker: Broker, body: Callable[[Broker], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        await broker.connect()
        try:
            return await body(broker)
        finally:
            await broker.close()

    return asyncio.run(main())


def messages(topic: str, n: int) -> list[Message]:
    return [
        build_message(
            topic,
            {"n": i},
            key=f"k{i}",
            tags=["a", "b"],
            headers={"trace": f"t{i}"},
            max_payload_bytes=1000,
        )
        for i in range(n)
    ]


def test_results_in_order_with_receipts_and_everything_carried(harness: Harness) -> None:
    topic = f"{harness.prefix}.orders"
    batch = messages(topic, 50)
    broker = harness.make()
    results = run(broker, lambda b: b.publish(batch))
    assert [r.outcome for r in results] == [Outcome.OK] * 50
    assert all(r.receipt for r in results)
    if harness.unique_receipts:
        assert len({r.receipt for r in results}) == 50
    stored = harness.read(broker, topic)
    assert [s["msg_id"] for s in stored] == [m.msg_id for m in batch], "stored in publish order"
    if harness.ordered_receipts:
        assert [s["receipt"] for s in stored] == [r.receipt for r in results]
    first = stored[0]
    assert first["payload"] == batch[0].payload
    assert first["headers"]["trace"] == "t0"
    assert first["headers"]["Outbox-Key"] == "k0" and first["headers"]["Outbox-Tags"] == "a,b"


def test_permanent_failure_stays_with_its_own_message(harness: Harness) -> None:
    good = messages(f"{harness.prefix}.orders", 4)
    bad = harness.poison(f"{harness.prefix}.poison")
    broker = harness.make()
    results = run(broker, lambda b: b.publish([good[0], good[1], bad, good[2], good[3]]))
    assert [r.outcome for r in results] == [Outcome.OK] * 2 + [Outcome.PERMANENT] + [Outcome.OK] * 2
    assert results[2].error
    assert [s["msg_id"] for s in harness.read(broker, f"{harness.prefix}.orders")] == [
        m.msg_id for m in good
    ]


def test_second_copy_of_a_msg_id(harness: Harness) -> None:
    [message] = messages(f"{harness.prefix}.orders", 1)
    broker = harness.make()

    async def twice(b: Broker) -> list[Any]:
        return [*(await b.publish([message])), *(await b.publish([message]))]

    first, second = run(broker, twice)
    assert first.ok and second.ok
    stored = harness.read(broker, f"{harness.prefix}.orders")
    if harness.dedup:
        assert second.duplicate and len(stored) == 1
    else:  # documented: consumers dedupe by msg_id
        assert len(stored) == 2 and stored[0]["msg_id"] == stored[1]["msg_id"]


def test_retry_while_down_and_publish_again_after_restart(restartable: Harness) -> None:
    h = restartable
    topic = f"{h.prefix}.orders"
    broker = h.make()

    async def scenario(b: Broker) -> dict[str, Any]:
        before = await b.publish(messages(topic, 3))
        await asyncio.to_thread(h.server.stop)
        down = await b.publish(messages(topic, 3))
        await asyncio.to_thread(h.server.start)
        deadline = time.monotonic() + 15
        after = await b.publish(messages(topic, 3))
        while not all(r.ok for r in after) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            after = await b.publish(messages(topic, 3))
        return {"before": before, "down": down, "after": after}

    out = run(broker, scenario)
    assert all(r.ok for r in out["before"])
    assert [r.outcome for r in out["down"]] == [Outcome.RETRY] * 3
    assert all(r.ok for r in out["after"]), [r.error for r in out["after"]]


def test_redis_driver_options_in_the_url_reach_the_driver() -> None:
    """``?password=`` is redis-py's option, not ours: the adapter keeps it in the URL it
    hands to redis-py (it used to drop the whole query, so the password never reached
    the server) and takes only its own options out."""
    import redis.asyncio as aioredis

    from relay.brokers.redis import RedisBroker

    broker = RedisBroker("redis://127.0.0.1:6379/0?password=pw-in-query&prefix=x:&maxlen=5")
    assert (broker.prefix, broker.maxlen) == ("x:", 5)
    options = aioredis.from_url(broker.url).connection_pool.connection_kwargs
    assert options["password"] == "pw-in-query"
    assert "prefix" not in options and "maxlen" not in options
