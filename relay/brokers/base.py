"""The one protocol every broker adapter implements: connect, publish a batch, close."""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from outbox.config import mask_url
from outbox.errors import OutboxError
from outbox.message import Message

NOT_CONNECTED = "not connected"  # every adapter's error while it has no connection
# Exceptions that say the connection, not the message, failed.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, ConnectionError)

log = logging.getLogger("relay.brokers")
# Reading a broker's log back: entries come in chunks of LOG_CHUNK at most, each a
# LogRow (msg_id, topic, seq, broker_ts: the columns of the broker log export).
LOG_CHUNK = 50_000
READ_TIMEOUT_S = 30.0  # a broker silent this long while read is stuck, not done
LogRow = dict[str, object]


class Outcome(enum.Enum):
    OK = "ok"
    RETRY = "retry"  # may succeed later: timeouts, disconnects, overload
    PERMANENT = "permanent"  # will not succeed as it is: unroutable, rejected, too large


@dataclass(frozen=True, slots=True)
class PublishResult:
    outcome: Outcome
    receipt: str | None = None  # the broker's id for the stored message, e.g. a stream sequence
    error: str | None = None
    duplicate: bool = False  # the broker already held this msg_id and dropped the copy

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


def ok(receipt: str, duplicate: bool = False) -> PublishResult:
    return PublishResult(Outcome.OK, receipt=receipt, duplicate=duplicate)


def retry(error: str) -> PublishResult:
    return PublishResult(Outcome.RETRY, error=error)


def permanent(error: str) -> PublishResult:
    return PublishResult(Outcome.PERMANENT, error=error)


class Broker(abc.ABC):
    """A connection to one broker, used from one asyncio loop.

    ``publish`` never raises for a message's own failure: it returns one result per
    message, in the order given, and keeps many publishes in flight at once. An
    exception about one message (encoding, size, destination, a client library's
    TypeError) becomes that message's PERMANENT result; only a connection-level failure
    makes every result RETRY.
    """

    @abc.abstractmethod
    async def connect(self) -> None: ...

    @abc.abstractmethod
    async def publish(self, messages: Sequence[Message]) -> list[PublishResult]: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> Broker:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


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


def unreachable(url: str, reason: object) -> OutboxError:
    """A log reader's error: the broker did not answer (the URL masked)."""
    return OutboxError(f"broker {mask_url(url)} unreachable ({reason}); nothing was written")


def utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
