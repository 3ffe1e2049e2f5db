"""What a broker is to the outbox, both ways: ``Broker`` publishes, ``LogReader`` reads
back what the broker holds. A leaf module: the app layer types ``Outbox(broker=...)``
with it, the relay's adapters (``relay.brokers``) and test doubles (``relay.testing``)
implement it.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol, runtime_checkable

# BROKER_SCHEMES, the one table of product broker URL schemes: scheme -> broker family,
# derived from the registrations (outbox.brokers_registry). Test doubles have no scheme.
from outbox.brokers_registry import BROKER_SCHEMES as BROKER_SCHEMES
from outbox.message import Message


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


@runtime_checkable
class Broker(Protocol):
    """A connection to one broker, used from one asyncio loop.

    ``publish`` never raises for a message's own failure: it returns one result per
    message, in the order given, and keeps many publishes in flight at once. An
    exception about one message (encoding, size, destination, a client library's
    TypeError) becomes that message's PERMANENT result; only a connection-level failure
    makes every result RETRY. ``connect`` may be called again after ``close``.
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


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One message as the broker holds it, read back.

    An entry the relay cannot have written (a stranger's: headers that are not JSON or
    not text, no msg_id, an Outbox-Seq that is no whole number) is still one entry:
    ``malformed`` says why, ``raw`` holds its fields as printable ASCII (escaped, cut
    short), and the other fields hold what could be salvaged. Readers never raise for it.
    """

    msg_id: str | None  # None: stored by someone else than the relay
    topic: str
    seq: str  # its place in the broker's log: stream sequence, entry id, stream offset
    broker_ts: datetime | None  # when the broker stored it (UTC), as precise as it keeps it
    payload: bytes
    headers: dict[str, str]  # the app's headers, key and tags (never the broker's own)
    # What the broker keeps beside the headers, by its own names (AMQP's content_type).
    properties: dict[str, object] = field(default_factory=dict)
    malformed: str | None = None  # why the relay cannot have written it; None: it could
    raw: str | None = None  # a malformed entry's fields, escaped (relay.brokers.base.raw_text)


@runtime_checkable
class LogReader(Protocol):
    """Reads a broker's log back, in bounded memory: the other direction of ``Broker``.

    ``sources`` says where the log is, in the broker's terms: JetStream stream names
    (NATS), topics (Redis Streams, memory), the audit stream queue (RabbitMQ). Empty
    means the broker URL's own where it names one (``?stream=``, ``?audit=``).
    Entries come in publish order per source, in chunks of bounded size, stored in
    [since, until) as far as the broker's clock tells; the chunks end with what the
    log held when the read began. A reader opens its own connection: ``connect()`` is
    not needed first. A broker that cannot be reached, or a missing source, raises
    ``outbox.errors.OutboxError`` before the first chunk.
    """

    @abc.abstractmethod
    def read_log(
        self,
        sources: Sequence[str] = (),
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> AsyncIterator[list[LogEntry]]: ...
