"""What the broker adapters share: the safety net around ``publish``, and the log readers'
chunks, errors and times. The protocols themselves (``Broker``, ``LogReader``) and their
value types are in ``outbox.broker``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import UTC, datetime

from outbox.broker import Broker, LogEntry, PublishResult, permanent, retry
from outbox.errors import ConfigError, OutboxError
from outbox.message import Message
from outbox.secrets import mask_url

NOT_CONNECTED = "not connected"  # every adapter's error while it has no connection
# Exceptions that say the connection, not the message, failed.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, ConnectionError)

log = logging.getLogger("relay.brokers")
# Reading a broker's log back: entries come in chunks of at most LOG_CHUNK entries and
# about LOG_CHUNK_BYTES of payload, so a reader's memory does not grow with the log.
LOG_CHUNK = 50_000
LOG_CHUNK_BYTES = 64 * 1024 * 1024
READ_TIMEOUT_S = 30.0  # a broker silent this long while read is stuck, not done


def unexpected(exc: BaseException) -> PublishResult:
    """The result of a message whose publish raised an exception no adapter foresaw."""
    return permanent(f"{type(exc).__name__}: {exc}")


async def publish_isolated(broker: Broker, messages: Sequence[Message]) -> list[PublishResult]:
    """``broker.publish(messages)``, with a fault of one message kept to that message.

    Safety net for an adapter that still raises from ``publish`` as a whole (or answers
    with the wrong number of results) for a reason other than its connection: each
    message is then published alone, concurrently, and a message whose own publish
    raises gets a PERMANENT result. Trade-off: messages the failed batch call had
    already handed to the broker are published a second time, so this costs at most
    one extra copy per message per call (at least once, as after a crash; JetStream
    drops it by msg_id), instead of a rolled-back batch republished on every pass.
    A connection-level exception (CONNECTION_ERRORS) makes every result RETRY.
    """
    try:
        results = await broker.publish(messages)
        if len(results) == len(messages):
            return results
        error: BaseException = RuntimeError(
            f"{len(results)} result(s) for {len(messages)} message(s)"
        )
    except CONNECTION_ERRORS as exc:
        return [retry(f"{type(exc).__name__}: {exc}") for _ in messages]
    except Exception as exc:
        error = exc
    if len(messages) == 1:
        return [unexpected(error)]
    log.warning(
        "publish of %d message(s) raised %s; publishing them one by one",
        len(messages), type(error).__name__,
    )  # fmt: skip
    return list(await asyncio.gather(*(_alone(broker, m) for m in messages)))


async def _alone(broker: Broker, message: Message) -> PublishResult:
    try:
        [result] = await broker.publish([message])
    except CONNECTION_ERRORS as exc:
        return retry(f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        return unexpected(exc)
    return result


class BrokerRefused(ConfigError):
    """The broker answered and refused what the broker URL asks it to set up (a stream,
    an exchange, a queue): connecting again changes nothing until a setting or the
    broker does. The message holds the broker's own words and the setting to change.
    The relay's connect loop logs it as a refusal, never as an unreachable broker."""


def unreachable(url: str, reason: object) -> OutboxError:
    """A log reader's error: the broker did not answer (the URL masked)."""
    return OutboxError(f"broker {mask_url(url)} unreachable ({reason}); nothing was written")


def utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Chunk:
    """Collects a reader's entries until it is ``full``, then ``take`` empties it."""

    __slots__ = ("bytes", "entries")

    def __init__(self) -> None:
        self.entries: list[LogEntry] = []
        self.bytes = 0

    def add(self, entry: LogEntry) -> None:
        self.entries.append(entry)
        self.bytes += len(entry.payload)

    @property
    def full(self) -> bool:
        return len(self.entries) >= LOG_CHUNK or self.bytes >= LOG_CHUNK_BYTES

    def take(self) -> list[LogEntry]:
        entries, self.entries, self.bytes = self.entries, [], 0
        return entries
