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

Reading back: ``RabbitBroker.read_log`` (the ``LogReader``) reads a stream queue (the
audit queue, or any stream queue bound to the exchange) up to an end marker it appends
itself, in chunks, for ``outbox export broker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import aio_pika
import aio_pika.exceptions as amqp_errors
import aiormq.exceptions as aiormq_errors

from outbox.broker import Broker, LogEntry, LogReader, PublishResult, ok, permanent, retry
from outbox.errors import ConfigError, OutboxError
from outbox.message import Message, carried_headers
from relay.brokers.base import (
    NOT_CONNECTED,
    READ_TIMEOUT_S,
    BrokerRefused,
    Chunk,
    checked,
    malformed,
    unexpected,
    unreachable,
    utc,
)
from relay.brokers.registrations import AMQP_SHORTSTR_BYTES

DEFAULT_EXCHANGE = "amq.topic"
MAX_ROUTING_KEY_BYTES = AMQP_SHORTSTR_BYTES  # its registration's max_topic_bytes
PREFETCH = 1_000  # a log read's unacked deliveries in flight (AMQP caps it at 65535)
MARKER_TYPE = "outbox.export-marker"


# RabbitMQ's refusals of what the URL declares: an exchange or queue that exists with
# other arguments (PRECONDITION_FAILED), or one the user may not configure (ACCESS_REFUSED).
REFUSALS = (aiormq_errors.ChannelPreconditionFailed, aiormq_errors.ChannelAccessRefused)
EXCHANGE_CURE = (
    "set ?exchange= in the broker URL (Outbox(broker=...), OUTBOX_BROKER, --broker) to a "
    "durable topic exchange, or to a name no exchange has yet"
)
AUDIT_CURE = (
    "set ?audit= in the broker URL (Outbox(broker=...), OUTBOX_BROKER, --broker) to a "
    "stream queue's name, or to a name no queue has yet"
)


async def topic_exchange(channel: Any, name: str) -> Any:
    """The exchange messages go to: amq.topic as it is, or a durable topic exchange of that
    name, declared (a BrokerRefused with the server's words when it is refused)."""
    if name == DEFAULT_EXCHANGE:
        return await channel.get_exchange(DEFAULT_EXCHANGE, ensure=False)
    with refusal(f"the exchange {name!r} (a durable topic exchange)", EXCHANGE_CURE):
        return await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True)


@contextmanager
def refusal(what: str, cure: str) -> Iterator[None]:
    """RabbitMQ's refusal to declare ``what`` becomes a BrokerRefused: its reply, ``cure``."""
    try:
        yield
    except REFUSALS as exc:
        reply = exc.args[0] if exc.args else str(exc)
        raise BrokerRefused(f"RabbitMQ refused to declare {what}: {reply}; {cure}") from None


class RabbitBroker(Broker, LogReader):
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
            exchange = await topic_exchange(channel, self.exchange_name)
            if self.audit_queue:
                with refusal(f"the audit queue {self.audit_queue!r} (a durable stream queue)",
                             AUDIT_CURE):  # fmt: skip
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
        headers = carried_headers(message)
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

    async def read_log(
        self,
        sources: Sequence[str] = (),
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> AsyncIterator[list[LogEntry]]:
        """The ``LogReader``: ``sources`` names one stream queue, by default the URL's
        ?audit=."""
        queues = list(sources) or ([self.audit_queue] if self.audit_queue else [])
        if len(queues) != 1:
            raise ConfigError("broker: name one audit stream queue to read (--queue)")
        async for entries in read_queue(self.url, queues[0], since, until):
            yield entries

    async def log_sources(self, names: Sequence[str] = ()) -> dict[str, list[str]]:
        """The stream queue an export reads: ``names`` or the URL's ?audit=. It is bound
        to the exchange with ``#``: it captures every topic."""
        queues = list(dict.fromkeys(names)) or ([self.audit_queue] if self.audit_queue else [])
        if len(queues) != 1:
            raise ConfigError("broker: name one audit stream queue to read (--queue)")
        return {queues[0]: [">"]}


# A frame the client cannot decode (pamqp fails the whole connection on a message_id or
# header that is not UTF-8): only a stranger's raw client can have sent it.
UNDECODABLE = aiormq_errors.InvalidFrameError


class Place:
    """How far a read has come: the stream offset of the last delivery taken."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: int | None = None

    def took(self, message: Any) -> None:
        offset = (message.headers or {}).get("x-stream-offset")
        if isinstance(offset, int):
            self.last = offset


class QuietUndecodable(logging.Filter):
    """Drops aiormq's warning (with a traceback) about a frame it could not decode, while
    a read turns that entry into a malformed one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], UNDECODABLE))


class Closed:
    """Put in the inbox when the connection closes, with what closed it."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


async def read_queue(
    url: str, queue_name: str, since: datetime | None = None, until: datetime | None = None
) -> AsyncIterator[list[LogEntry]]:
    """What a stream queue holds (published in [since, until)), in chunks.

    The queue is the one the relay's ``?audit=QUEUE`` declares. broker_ts is the
    relay's publish time (the AMQP ``timestamp``, in whole seconds: RabbitMQ stores no
    arrival time per message), so the window is widened to whole seconds; extra rows
    at its edges do no harm, since reconciliation matches by msg_id.

    An entry the client cannot decode closes the connection: the read goes on from
    the offset after the last entry taken, on a new connection; a read that fails there
    before any delivery has found the undecodable entry's offset, which becomes a
    malformed entry, and the read goes on after it.
    """
    place = Place()
    start: datetime | str | int = since if since else "first"
    quiet, aiormq_log = QuietUndecodable(), logging.getLogger("aiormq.connection")
    aiormq_log.addFilter(quiet)
    try:
        while True:
            before = place.last
            try:
                async for entries in read_from(url, queue_name, start, since, until, place):
                    yield entries
                return
            except UNDECODABLE as exc:
                if place.last is None:
                    raise OutboxError(
                        f"broker export: the first entry read from {queue_name!r} cannot be "
                        f"decoded ({exc}); read from a later --since"
                    ) from None
                if isinstance(start, int) and place.last == before:  # failed at ``start``
                    yield [undecodable(start, exc)]
                    place.last = start
                start = place.last + 1
    finally:
        aiormq_log.removeFilter(quiet)


def undecodable(offset: int, exc: BaseException) -> LogEntry:
    """The malformed entry at ``offset`` that the client could not decode."""
    stranger = LogEntry(None, "", str(offset), None, b"", {})
    reason = f"an AMQP frame the client cannot decode ({exc})"
    return malformed(stranger, reason, {"offset": offset, "error": str(exc)})


async def read_from(
    url: str,
    queue_name: str,
    start: datetime | str | int,
    since: datetime | None,
    until: datetime | None,
    place: Place,
) -> AsyncIterator[list[LogEntry]]:
    """One connection's read from ``start`` (an offset spec) up to a marker of its own."""
    try:
        connection = await aio_pika.connect(url, timeout=READ_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:  # aio_pika's connection errors are OSErrors
        raise unreachable(url, exc) from None
    inbox: asyncio.Queue[Any] = asyncio.Queue()  # holds at most PREFETCH messages
    connection.close_callbacks.add(lambda _, exc: inbox.put_nowait(Closed(exc)))
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=PREFETCH)  # stream queues refuse consumers without
        try:
            queue = await channel.get_queue(queue_name, ensure=True)
        except amqp_errors.ChannelNotFoundEntity:
            raise OutboxError(
                f"no queue {queue_name!r}: set ?audit={queue_name} on the relay's broker URL"
            ) from None
        # pamqp sends a datetime as an AMQP timestamp (whole seconds): attach by time.
        await queue.consume(inbox.put, arguments={"x-stream-offset": start})
        try:
            marker: str | None = await publish_marker(channel, queue_name)
        except UNDECODABLE:
            marker = None  # the connection failed on a delivery: Closed follows in the inbox
        async for rows in read_until_marker(inbox, marker, since, until, place):
            yield rows
    finally:
        with contextlib.suppress(Exception):  # a connection a bad frame closed is gone
            await connection.close()


async def publish_marker(channel: Any, queue_name: str) -> str:
    """Append a marker to the stream; reading up to it is reading everything there now.

    Streams over AMQP 0-9-1 report no message count or last offset, and waiting for
    silence never ends while the relay keeps publishing, so the reader marks the end
    itself: one small message per read (readers skip markers, theirs and earlier ones).
    """
    marker = f"outbox-export-{uuid.uuid4()}"
    message = aio_pika.Message(b"", message_id=marker, type=MARKER_TYPE)
    await channel.default_exchange.publish(message, routing_key=queue_name)
    return marker


async def read_until_marker(
    inbox: asyncio.Queue[Any],
    marker: str | None,
    since: datetime | None,
    until: datetime | None,
    place: Place,
) -> AsyncIterator[list[LogEntry]]:
    first = whole_second(since)  # attaching by time starts at a chunk: filter here too
    chunk = Chunk()
    while True:
        try:
            item = await asyncio.wait_for(inbox.get(), READ_TIMEOUT_S)
        except TimeoutError:
            raise OutboxError(
                f"broker export: no delivery for {READ_TIMEOUT_S:.0f} s before the end marker"
            ) from None
        if isinstance(item, Closed):  # what was taken is yielded before the error
            if chunk.entries:
                yield chunk.take()
            raise item.error or OutboxError("broker export: the connection closed")
        place.took(item)
        if item.message_id is not None and item.message_id == marker:
            break
        ts = utc(item.timestamp)
        if item.type != MARKER_TYPE and in_window(ts, first, until):
            chunk.add(entry_of(item, ts))
        if chunk.full:
            yield chunk.take()
        # a stream queue sends more only as deliveries are acked; an ack fails when the
        # connection has closed, and the Closed item that follows says why
        with contextlib.suppress(aiormq_errors.AMQPError, aiormq_errors.ChannelInvalidStateError):
            await item.ack()
    if chunk.entries:
        yield chunk.take()


def entry_of(message: Any, ts: datetime | None) -> LogEntry:
    """A delivery from the stream: the offset the server adds is its place, not a header.
    One the relay cannot have written (no message_id, a header that is not text: AMQP
    headers may hold numbers, bytes, tables) is a malformed entry, never an exception."""
    headers: Any = dict(message.headers or {})
    offset = headers.pop("x-stream-offset", None)
    entry = LogEntry(
        message.message_id,
        message.routing_key or "",
        str(offset),
        ts,
        message.body,
        headers,
        {"content_type": message.content_type},
    )
    return checked(entry)


def in_window(ts: datetime | None, since: datetime | None, until: datetime | None) -> bool:
    if ts is None:  # published before the adapter set timestamps: keep it
        return True
    return (since is None or ts >= since) and (until is None or ts < until)


def whole_second(moment: datetime | None) -> datetime | None:
    value = utc(moment)
    return value.replace(microsecond=0) if value is not None else None
