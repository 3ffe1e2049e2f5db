"""One broker test harness for every broker: a namespace of the test's own on a real
broker (or in memory), published to through the adapter and read back through its
``LogReader``, cleaned up afterwards. One suite runs against every kind, as river's
``riverdrivertest.Exercise`` runs one suite against every driver.

Kinds: every registered broker family (``outbox.brokers_registry``), each set up by the
harness factory its registration names, and ``memory`` (a ``MemoryBroker``). The
product's: ``nats`` (a stream of its own on a ``NatsServer``: the one given, else a new
one), ``rabbitmq`` and ``redis`` (the running servers, with a stream queue or keys of
their own). Every topic ``<prefix>.<anything>`` is captured and read back.

A harness factory takes the test's prefix and the ``HarnessOptions`` and yields one
``BrokerUnderTest``, cleaning up after it (``nats_under_test`` below is one).

Example::

    with broker_under_test("redis") as bt:
        run(bt.make(), messages)          # publish through the adapter
        entries = bt.read(f"{bt.prefix}.orders")  # read back through the LogReader
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from outbox.broker import Broker, LogEntry, LogReader, permanent
from outbox.brokers_registry import registrations, resolve
from outbox.message import Message, build_message
from relay.testing.embedded import NatsServer
from relay.testing.faults import TcpProxy
from relay.testing.memory import MemoryBroker

MEMORY = "memory"
AMQP_PORT = int(os.environ.get("OUTBOX_TEST_RABBIT_PORT", "5672"))
REDIS_PORT = int(os.environ.get("OUTBOX_TEST_REDIS_PORT", "6379"))


class Restartable(Protocol):
    def stop(self) -> None: ...

    def start(self) -> Any: ...


@dataclass
class BrokerUnderTest:
    """A broker namespace of one test's own, both ways."""

    kind: str
    prefix: str  # every topic "<prefix>.<anything>" is captured
    url: str | None  # the product URL an Outbox or `outbox relay` takes (None: memory)
    make: Callable[[], Broker]  # the adapter (not connected); memory: always the same one
    reader: LogReader
    sources: Callable[[], list[str]]  # where the reader finds what was published so far
    poison: Callable[[str], Message]  # a message this broker refuses for good (its topic
    # may differ from the one asked for when the refusal is about the destination)
    dedup: bool  # the broker drops a second copy of a msg_id
    server: Restartable | None  # stop() and start() it to take the broker away and back
    receipt_of: Callable[[LogEntry], str | None]  # the publish receipt of a stored entry
    ordered_receipts: bool = True  # stored entries show the receipts the publisher got
    unique_receipts: bool = True  # one broker id per message (RabbitMQ acks cover several)

    async def read_async(self, topic: str | None = None) -> list[LogEntry]:
        """What the broker holds now (for ``topic``, or every captured topic)."""
        sources = self.sources()
        if not sources:
            return []
        found = [e async for chunk in self.reader.read_log(sources) for e in chunk]
        return [e for e in found if topic is None or e.topic == topic]

    def read(self, topic: str | None = None) -> list[LogEntry]:
        return asyncio.run(self.read_async(topic))


@dataclass(frozen=True)
class HarnessOptions:
    """What a test asks of its broker beside the kind."""

    nats_server: NatsServer | None = None  # NATS: this server, not a new one of its own
    restartable: bool = False  # ``server`` can stop() and start() the broker


def kinds() -> tuple[str, ...]:
    """Every kind the harness sets up: the registered brokers that name a harness, and
    memory."""
    return (*(f for f, r in registrations().items() if r.harness is not None), MEMORY)


def broker_families() -> list[str]:
    """The registered brokers the harness sets up, memory left out (a real broker each)."""
    return [kind for kind in kinds() if kind != MEMORY]


@contextlib.contextmanager
def broker_under_test(
    kind: str, *, nats_server: NatsServer | None = None, restartable: bool = False
) -> Iterator[BrokerUnderTest]:
    """A broker of ``kind`` for a block. ``restartable``: RabbitMQ and Redis are reached
    through a ``TcpProxy`` that ``server.stop()`` cuts (NATS restarts its own server)."""
    prefix = f"h{uuid.uuid4().hex[:10]}"
    if kind == MEMORY:
        yield _memory(prefix)
        return
    registration = registrations().get(kind)
    if registration is None or registration.harness is None:
        raise ValueError(f"kind must be one of {', '.join(kinds())}, got {kind!r}")
    factory = resolve(registration.harness)
    yield from factory(prefix, HarnessOptions(nats_server, restartable))


def nats_under_test(prefix: str, options: HarnessOptions) -> Iterator[BrokerUnderTest]:
    """The NATS harness: a stream of the test's own on the server given, else a new one."""
    if options.nats_server is not None:
        yield from _nats(options.nats_server, prefix)
    else:
        with NatsServer() as server:
            yield from _nats(server, prefix)


def rabbitmq_under_test(prefix: str, options: HarnessOptions) -> Iterator[BrokerUnderTest]:
    """The RabbitMQ harness: the running server, a stream queue of the test's own."""
    with _reached(AMQP_PORT, options.restartable) as (reach, proxy):
        yield from _rabbit(prefix, AMQP_PORT, reach, proxy)


def redis_under_test(prefix: str, options: HarnessOptions) -> Iterator[BrokerUnderTest]:
    """The Redis harness: the running server, keys of the test's own."""
    with _reached(REDIS_PORT, options.restartable) as (reach, proxy):
        yield from _redis(prefix, REDIS_PORT, reach, proxy)


@contextlib.contextmanager
def _reached(port: int, restartable: bool) -> Iterator[tuple[int, TcpProxy | None]]:
    """The port to reach a running server at: its own, or a ``TcpProxy``'s to cut."""
    proxy = TcpProxy(port).start() if restartable else None
    try:
        yield (proxy.port if proxy is not None else port), proxy
    finally:
        if proxy is not None:
            proxy.stop()


def _nats(server: NatsServer, prefix: str) -> Iterator[BrokerUnderTest]:
    from relay.brokers.nats import NatsBroker

    stream = f"H_{prefix}"
    url = f"{server.url}?stream={stream}&subjects={prefix}.>"
    yield BrokerUnderTest(
        "nats",
        prefix,
        url,
        lambda: NatsBroker(url),
        NatsBroker(url),
        lambda: [stream],
        # over the server's max_payload (1 MiB by default)
        lambda topic: build_message(topic, b"x" * (1024 * 1024), max_payload_bytes=2**21),
        dedup=True,
        server=server,
        receipt_of=lambda entry: f"{stream}:{entry.seq}",
    )
    asyncio.run(_delete_stream(server.url, stream))


async def _delete_stream(url: str, stream: str) -> None:
    import nats
    import nats.js.errors

    with contextlib.suppress(Exception):  # the server may be gone already
        nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await nc.jetstream().delete_stream(stream)
        await nc.close()


def _rabbit(
    prefix: str, port: int, reach: int, proxy: TcpProxy | None
) -> Iterator[BrokerUnderTest]:
    """amq.topic, as a product URL uses it, and a stream queue of the test's own bound to
    ``<prefix>.#``: the log the reader reads (RabbitMQ keeps none of its own). A topic
    outside the prefix reaches no queue: the broker returns it as unroutable."""
    from relay.brokers.rabbitmq import RabbitBroker

    direct = f"amqp://guest:guest@127.0.0.1:{port}/"
    url = f"amqp://guest:guest@127.0.0.1:{reach}/"
    queue = f"harness-{prefix}"
    asyncio.run(_rabbit_queue(direct, queue, f"{prefix}.#", declare=True))
    try:
        yield BrokerUnderTest(
            "rabbitmq",
            prefix,
            url,
            lambda: RabbitBroker(url),
            RabbitBroker(direct),
            lambda: [queue],
            lambda topic: build_message(f"unbound-{topic}", b"x", max_payload_bytes=1000),
            dedup=False,
            server=proxy,
            receipt_of=lambda entry: None,  # a confirm's delivery tag, not kept by the queue
            ordered_receipts=False,
            unique_receipts=False,
        )
    finally:
        asyncio.run(_rabbit_queue(direct, queue, "", declare=False))


async def _rabbit_queue(url: str, queue: str, binding: str, declare: bool) -> None:
    import aio_pika

    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        if declare:
            q = await channel.declare_queue(
                queue, durable=True, arguments={"x-queue-type": "stream"}
            )
            await q.bind("amq.topic", routing_key=binding)
        else:
            await channel.queue_delete(queue)
    finally:
        await connection.close()


def _redis(prefix: str, port: int, reach: int, proxy: TcpProxy | None) -> Iterator[BrokerUnderTest]:
    """Keys of the test's own (``?prefix=``); every captured topic is a stream there."""
    import redis

    from relay.brokers.redis import RedisBroker

    key_prefix = f"{prefix}:"
    url = f"redis://127.0.0.1:{reach}/0?prefix={key_prefix}"
    client = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0")

    def sources() -> list[str]:
        keys = sorted(k.decode() for k in client.scan_iter(match=f"{key_prefix}*", _type="stream"))
        return [key.removeprefix(key_prefix) for key in keys]

    def poison(topic: str) -> Message:
        client.set(key_prefix + topic, "not a stream")  # XADD to it fails with WRONGTYPE
        return build_message(topic, b"x", max_payload_bytes=1000)

    try:
        yield BrokerUnderTest(
            "redis",
            prefix,
            url,
            lambda: RedisBroker(url),
            RedisBroker(f"redis://127.0.0.1:{port}/0?prefix={key_prefix}"),
            sources,
            poison,
            dedup=False,
            server=proxy,
            receipt_of=lambda entry: entry.seq,
        )
    finally:
        if keys := list(client.scan_iter(match=f"{key_prefix}*")):
            client.delete(*keys)
        client.close()


def _memory(prefix: str) -> BrokerUnderTest:
    broker = MemoryBroker(
        policy=lambda m: permanent("refused") if m.topic.endswith(".poison") else None
    )

    def topics() -> list[str]:
        return sorted({m.topic for m in broker.published})

    return BrokerUnderTest(
        "memory",
        prefix,
        None,
        lambda: broker,
        broker,
        topics,
        lambda topic: build_message(f"{topic}.poison", b"x", max_payload_bytes=1000),
        dedup=True,
        server=None,
        receipt_of=lambda entry: entry.seq,
    )
