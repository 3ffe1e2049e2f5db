"""RabbitMQ for the inbox: a durable quorum queue named after the inbox's consumer,
bound to the relay's exchange with the inbox's patterns.

The relay publishes every message to one topic exchange (``amq.topic`` unless the URL
names another) with routing key = topic, ``message_id`` = msg_id and the headers as
AMQP headers (relay.brokers.rabbitmq). A pattern's ``*`` is AMQP's ``*``; a final ``>``
(one token or more) binds as ``*.#``. Processes of one consumer consume from the same
queue, so they share the messages; each takes at most a batch unacked (the prefetch).

A message is acked after the inbox's commit. A retry is a ``reject(requeue=True)``
once the backoff's delay is over, scheduled on the event loop so that the others go on
meanwhile (the waiting message holds one place of the prefetch). The queue is a quorum
queue, whose ``x-delivery-count`` header counts the returns: the attempt survives a
restart. A message the outbox did not send (no msg_id in the relay's form: aiormq gives
one without a message_id a UUID's bare hex) is rejected without a requeue (dropped, or
dead-lettered where the queue has a policy for that) and logged. Unacked messages of a
process that dies, or stops, go back to the queue at once.

URL: ``amqp://user:pass@host:5672/vhost[?exchange=NAME&timeout=1]``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import aio_pika
import aio_pika.abc
import aio_pika.exceptions
import aiormq.exceptions

from outbox.errors import ConfigError, OutboxError
from outbox.secrets import mask_url
from relay.brokers.rabbitmq import DEFAULT_EXCHANGE, refusal, topic_exchange
from relay.consume.deliveries import Delivery, Subscription

log = logging.getLogger("relay.consume")
COUNT_HEADER = "x-delivery-count"  # a quorum queue's: how often the message came back
QUEUE_CURE = (
    "the consumer's queue must be a durable quorum queue: delete the queue of that name, "
    "or name the inbox's consumer otherwise"
)
OUR_OPTIONS = ("exchange", "audit", "timeout")  # the relay's; the rest is aio-pika's
SETTLE_ERRORS = (aiormq.exceptions.AMQPError, aio_pika.exceptions.AMQPError, RuntimeError, OSError)


class RabbitSubscription(Subscription):
    def __init__(self, url: str, consumer: str, patterns: Sequence[str]) -> None:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.exchange_name = query.get("exchange", DEFAULT_EXCHANGE)
        try:
            self.timeout = float(query.get("timeout", "1"))
        except ValueError:
            raise ConfigError("broker: 'timeout' must be a number of seconds") from None
        theirs = {k: v for k, v in query.items() if k not in OUR_OPTIONS}
        theirs.setdefault("reconnect_interval", "0.5")
        self.url = parts._replace(query=urlencode(theirs)).geturl()
        self.consumer, self.patterns = consumer, list(patterns)
        self.routing_keys = sorted({routing_key(p) for p in self.patterns})
        self._connection: Any = None
        self._queue: aio_pika.abc.AbstractQueue | None = None
        self._consuming = False
        self._arrived: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        self._timers: set[asyncio.TimerHandle] = set()
        self._settling: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        try:
            self._connection = await aio_pika.connect_robust(self.url, timeout=self.timeout * 5)
        except (OSError, TimeoutError, aio_pika.exceptions.AMQPError) as exc:
            raise OutboxError(f"broker {mask_url(self.url)} unreachable: {exc}") from None
        try:
            self._queue = await self.declare()
        except BaseException:
            await self.close()
            raise

    async def declare(self) -> aio_pika.abc.AbstractQueue:
        """The consumer's quorum queue, bound to the exchange with each pattern."""
        channel: aio_pika.abc.AbstractChannel = await self._connection.channel()
        exchange = await topic_exchange(channel, self.exchange_name)
        with refusal(f"the queue {self.consumer!r} (a durable quorum queue)", QUEUE_CURE):
            queue = await channel.declare_queue(
                self.consumer, durable=True, arguments={"x-queue-type": "quorum"}
            )
        for key in self.routing_keys:
            await queue.bind(exchange, routing_key=key)
        log.info("consumer %s: queue %s, bound to %s with %s", self.consumer, self.consumer,
                 self.exchange_name, ", ".join(self.routing_keys))  # fmt: skip
        return queue

    async def fetch(self, most: int, wait_s: float) -> list[Delivery]:
        """What arrived, up to ``most``; the first fetch starts consuming with a prefetch
        of ``most``."""
        if not self._consuming:
            await self.consume(most)
        try:
            first = await asyncio.wait_for(self._arrived.get(), wait_s)
        except TimeoutError:
            return []
        found = [first]
        while len(found) < most and not self._arrived.empty():
            found.append(self._arrived.get_nowait())
        return [self.delivery(m) for m in found]

    async def consume(self, prefetch: int) -> None:
        if self._queue is None:
            raise OutboxError("the RabbitMQ subscription is not open")
        await self._queue.channel.set_qos(prefetch_count=prefetch)
        await self._queue.consume(self._arrived.put)
        self._consuming = True

    def delivery(self, message: aio_pika.abc.AbstractIncomingMessage) -> Delivery:
        headers = dict(message.headers or {})
        returns = headers.pop(COUNT_HEADER, 0)
        texts = {k: v for k, v in headers.items() if isinstance(v, str)}
        msg_id = relay_id(message.message_id) if len(texts) == len(headers) else None

        async def ack() -> None:
            await settle(message.ack(), "ack", message)

        async def retry(delay_s: float) -> None:
            def due() -> None:
                self._timers.discard(timer)
                self.requeue(message)

            timer = asyncio.get_running_loop().call_later(delay_s, due)
            self._timers.add(timer)

        async def reject() -> None:
            log.warning("consumer %s: message %r on %r rejected (dropped, not handled)",
                        self.consumer, message.message_id, message.routing_key)  # fmt: skip
            await settle(message.reject(requeue=False), "reject", message)

        attempt = returns + 1 if isinstance(returns, int) else 1
        return Delivery(msg_id, message.routing_key or "", message.body, texts, attempt,
                        ack, retry, reject)  # fmt: skip

    def requeue(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        """The retry's delay is over: give the message back (its delivery counted)."""
        task = asyncio.create_task(settle(message.reject(requeue=True), "requeue", message))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def lag(self) -> int | None:
        """The queue's ready messages plus this process's unacked deliveries it holds."""
        if self._queue is None:
            return None
        declared = await self._queue.channel.declare_queue(self._queue.name, passive=True)
        ready = declared.declaration_result.message_count
        return int(ready or 0) + self._arrived.qsize()

    async def close(self) -> None:
        for timer in self._timers:
            timer.cancel()  # the connection's close gives those messages back
        self._timers = set()
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        connection, self._connection, self._queue = self._connection, None, None
        self._consuming = False
        if connection is not None and not connection.is_closed:
            await connection.close()


async def settle(done: Any, what: str, message: aio_pika.abc.AbstractIncomingMessage) -> None:
    """Await an ack, reject or requeue; a channel lost meanwhile gives the message back
    (it comes again, and the inbox knows a copy of one it handled)."""
    try:
        await done
    except SETTLE_ERRORS as exc:
        log.warning("%s of %r failed: %s: %s", what, message.message_id, type(exc).__name__, exc)


def relay_id(message_id: str | None) -> str | None:
    """The message_id where it is a msg_id as the relay writes them (a UUID's canonical
    text); None for a stranger's: aiormq gives every message published without one a
    UUID's bare hex, which would otherwise pass for a msg_id."""
    try:
        return message_id if str(uuid.UUID(message_id or "")) == message_id else None
    except ValueError:
        return None


def routing_key(pattern: str) -> str:
    """A pattern (NATS syntax) as a binding: a final ``>`` (one or more tokens) is
    ``*.#`` (one, then zero or more)."""
    tokens = pattern.split(".")
    if tokens[-1] == ">":
        tokens[-1:] = ["*", "#"]
    return ".".join(tokens)
