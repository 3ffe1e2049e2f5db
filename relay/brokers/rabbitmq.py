"""RabbitMQ adapter (aio-pika, AMQP 0-9-1) with publisher confirms.

Mapping: every message goes to one exchange (``amq.topic`` unless the URL names
another) with routing key = topic, so queues bind with patterns such as
``warehouse.#``; ``message_id`` = msg_id (RabbitMQ does not deduplicate: consumers
dedupe by it); persistent delivery; app headers plus ``Outbox-Key`` /
``Outbox-Tags`` as AMQP headers; receipt = ``ack:<delivery tag>`` of the confirm,
which may cover several messages (RabbitMQ stores no per-message id to return).

Each message carries ``timestamp`` = the relay's publish time (whole seconds, as AMQP
has it): RabbitMQ keeps no arrival time per message, so this is the broker log's time.

Audit stream (``?audit=QUEUE``): RabbitMQ keeps no log of what was published, so
``connect()`` declares a durable stream queue bound to the exchange with ``#``; it keeps
a copy of every message for ``outbox export broker``. It must be set before the
messages are published. Trade-off: with it every message is routable, so a topic that
no other queue binds is no longer refused as unroutable. The stream grows until a
retention policy (``x-max-age`` / ``x-max-length-bytes``) trims it.

Outcomes: confirmed -> ok; returned as unroutable (``mandatory``) -> permanent (no
queue is bound: publishing again will not help); nacked -> retry; connection or
channel lost -> retry (the connection reconnects by itself).

URL: ``amqp://user:pass@host:5672/vhost[?exchange=NAME&audit=QUEUE&timeout=1&reconnect_interval=0.5]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import aio_pika
import aio_pika.exceptions as amqp_errors

from outbox.errors import ConfigError
from outbox.message import Message
from relay.brokers.base import (
    NOT_CONNECTED,
    Broker,
    PublishResult,
    ok,
    permanent,
    relay_headers,
    retry,
    unexpected,
)

DEFAULT_EXCHANGE = "amq.topic"
MAX_ROUTING_KEY_BYTES = 255  # AMQP 0-9-1 shortstr


class RabbitBroker(Broker):
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.exchange_name = query.pop("exchange", DEFAULT_EXCHANGE)
        self.audit_queue = query.pop("audit", None)
        try:
            self.timeout = float(query.pop("timeout", "1"))
        except ValueError:
            raise ConfigError("broker: 'timeout' must be a number of seconds") from None
        query.setdefault("reconnect_interval", "0.5")
        self.url = parts._replace(query=urlencode(query)).geturl()
        self._connection: Any = None
        self._exchange: Any = None

    async def connect(self) -> None:
        connection = await aio_pika.connect_robust(self.url, timeout=self.timeout * 5)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            if self.exchange_name == DEFAULT_EXCHANGE:
                exchange = await channel.get_exchange(DEFAULT_EXCHANGE, ensure=False)
            else:
                exchange = await channel.declare_exchange(
                    self.exchange_name, aio_pika.ExchangeType.TOPIC, durable=True
                )
            if self.audit_queue:
                audit = await channel.declare_queue(
                    self.audit_queue, durable=True, arguments={"x-queue-type": "stream"}
                )
                await audit.bind(exchange, routing_key="#")
        except BaseException:
            await connection.close()
            raise
        self._connection, self._exchange = connection, exchange

    async def publish(self, messages: Sequence[Message]) -> list[PublishResult]:
        if self._exchange is None or self._connection is None or self._connection.is_closed:
            return [retry(NOT_CONNECTED) for _ in messages]
        return list(await asyncio.gather(*(self._publish_one(m) for m in messages)))

    async def _publish_one(self, message: Message) -> PublishResult:
        """One message's outcome; an exception about this message never escapes."""
        size = len(message.topic.encode("utf-8", "surrogatepass"))
        if size > MAX_ROUTING_KEY_BYTES:
            return permanent(
                f"routing key is {size} bytes, AMQP allows {MAX_ROUTING_KEY_BYTES}: "
                f"{message.topic[:40]!r}..."
            )
        try:
            confirm = await self._exchange.publish(
                self._amqp_message(message),
                routing_key=message.topic,
                mandatory=True,
                timeout=self.timeout,
            )
        except amqp_errors.PublishError as exc:  # returned: no queue bound for the key
            return permanent(f"unroutable: {exc}")
        except amqp_errors.DeliveryError as exc:  # nack: the broker could not take it now
            return retry(f"nacked: {exc}")
        except (TimeoutError, amqp_errors.AMQPError, OSError, RuntimeError) as exc:
            return retry(f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # encoding (a lone surrogate), a client library's TypeError
            return unexpected(exc)
        return ok(f"ack:{getattr(confirm, 'delivery_tag', '')}")

    @staticmethod
    def _amqp_message(message: Message) -> aio_pika.Message:
        headers = relay_headers(message)
        return aio_pika.Message(
            message.payload,
            message_id=message.msg_id,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            content_type=headers.get("content-type"),
            timestamp=datetime.now(UTC),
            headers=headers,  # type: ignore[arg-type]
        )

    async def close(self) -> None:
        connection, self._connection, self._exchange = self._connection, None, None
        if connection is not None and not connection.is_closed:
            await connection.close()
